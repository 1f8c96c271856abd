"""Test set-up step (``make test``): install SGLang's storage interface where it can run
beside the installed torch, and nowhere else.

``sglang`` pins a CUDA torch and several GPU-only packages, so it is installed with
``--no-deps`` and only the light packages that ``sglang.srt.mem_cache`` (the HiCache
storage interface, the host KV pools) imports on a CPU machine are added beside it. The
tests import SGLang only in their own processes, with a stub for ``torchvision``
(tests/sglang_helpers/torchvision_stub.py): PyPI's torchvision does not import beside the
CPU torch, and the storage modules need it only to be importable.

- SGLang already importable (a host with its own SGLang): kept as it is.
- torch is the CPU build ``make`` installs (2.13.0+cpu): ``pip install --no-deps SPEC``,
  then the light packages with torch pinned to the installed version (pip may not replace
  it), then a check that the storage interface and the host pool import.
- any other torch (a CUDA build): nothing is installed (SGLang's CUDA modules would want
  its GPU kernels), and the SGLang tests skip saying why (tests/sglang_helpers/common.py).

Exits non-zero if the install was due and failed, so CI does not silently skip the tests.
Usage: ``python tests/sglang_helpers/install_sglang.py [SPEC]`` (default ``sglang==0.5.23``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

CPU_TORCH = "2.13.0+cpu"
# What `import sglang.srt.mem_cache.{hicache_storage,storage,pool_host.mha}` needs on a CPU
# machine (sglang 0.5.23's own requirements, the GPU and serving ones left out).
LIGHT = [
    "aiohttp",
    "gguf",
    "IPython",
    "msgspec",
    "orjson",
    "packaging",
    "pillow",
    "psutil",
    "pybase64",
    "pydantic",
    "pyzmq>=25.1.2",
    "requests",
    "setproctitle",
    "starlette",
    "tqdm",
    "transformers==5.19.0",
    "triton>=3.0",
]
CHECK = (
    "import tests.sglang_helpers.torchvision_stub; import sglang; "
    "from sglang.srt.mem_cache.storage import StorageBackendFactory; "
    "from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost; "
    "import torch; print(sglang.__version__, torch.__version__)"
)


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "sglang==0.5.23"
    if importlib.util.find_spec("sglang") is not None:
        print("SGLang is already installed: kept as it is")
        return 0
    try:
        import torch
    except ImportError:
        print("no torch: SGLang not installed, the SGLang tests will skip")
        return 0
    if torch.__version__ != CPU_TORCH:
        print(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CPU build "
            f"({CPU_TORCH}) the SGLang tests install {spec} beside: SGLang not installed, "
            "the SGLang tests will skip"
        )
        return 0
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    for step in ([*pip, "--no-deps", spec], [*pip, *LIGHT, f"torch=={torch.__version__}"]):
        done = subprocess.run(step)
        if done.returncode:
            print(f"installing {spec} failed at: {' '.join(step[3:])}", file=sys.stderr)
            return done.returncode
    check = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    if check.returncode:
        print(
            f"SGLang's storage interface does not import after installing {spec}:\n"
            f"{check.stderr[-2000:]}",
            file=sys.stderr,
        )
        return 1
    print(
        f"installed {spec} (--no-deps, with its storage interface's light packages) in "
        f"{time.monotonic() - started:.0f} s (sglang, torch: "
        f"{check.stdout.strip().splitlines()[-1]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
