"""GPU data path benchmark (the code lives in kvbroker/_bench/gpu_run.py, so that
``kvbroker bench gpu`` runs from an installed package).

Usage: ``python benchmarks/bench_gpu.py --out DIR [--pytest] [--name gpu]``.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if __name__ == "__main__":
    runpy.run_module("kvbroker._bench.gpu_run", run_name="__main__", alter_sys=True)
