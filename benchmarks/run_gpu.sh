#!/bin/bash
# The GPU host run behind benchmarks/results/gpu-h200.*: install the wheels carried in .whl/
# (the host has torch/triton but no network), then the CUDA tests, bench_gpu.py, the
# -k gpu/kernel/ring/cuda tests and bench_ttft.py, all outputs under $OUT.
R=${OUT:-/tmp/out}; mkdir -p $R
python -m pip install -q --no-index --find-links .whl msgpack posix_ipc typer prometheus_client xxhash google-re2 uvloop textual hypothesis pytest pytest-timeout "transformers>=5,<6" 2>&1 | grep -v -i warn | tail -3
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warn | tail -2
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt
echo "== my CUDA test files"; timeout ${T1:-150} python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_ring.py tests/test_kernels.py tests/test_ring.py > $R/pytest-gpu-files.txt 2>&1; tail -${TAIL:-12} $R/pytest-gpu-files.txt
echo "== bench_gpu"; timeout ${T2:-200} python benchmarks/bench_gpu.py --out $R --name gpu-h200 --reps 7 > $R/bench-gpu-log.txt 2>&1; grep -i -E "failed|error" $R/bench-gpu-log.txt | head; cat $R/gpu-h200.md
[ -n "$SKIP_FINAL" ] && exit 0
if [ -n "$FULL" ]; then  # the whole suite on the GPU host: CUDA tests run instead of skipping
    echo "== pytest (all)"; timeout ${T3:-300} python -m pytest -q -p no:cacheprovider -rs tests/ > $R/pytest-all-gpu.txt 2>&1; tail -15 $R/pytest-all-gpu.txt
else
echo "== pytest -k"; timeout ${T3:-150} python -m pytest -q -p no:cacheprovider --continue-on-collection-errors tests/ -k "gpu or kernel or ring or cuda" > $R/pytest-k-gpu.txt 2>&1; tail -8 $R/pytest-k-gpu.txt
fi
echo "== ttft"; timeout ${T4:-90} python benchmarks/bench_ttft.py --device cuda --dtype bf16 --out $R/ttft-cuda-h200 > $R/ttft-log.txt 2>&1; tail -25 $R/ttft-log.txt
