#!/bin/bash
# The GPU host run for issue 17's integrity part: the checksum/engine/GPU-checksum tests with
# CUDA, then bench_integrity_gpu.py (2 GiB GPU checksum vs a read and a D2D copy, D2H/H2D
# with the checksum beside them; 32 MiB host put+get, 1 vs N threads vs a multi-threaded
# memcpy, against a private daemon). Wheels as in run_gpu.sh (the host has torch/triton but no
# network); outputs under $OUT (or /tmp/out) and benchmarks/results/integrity-gpu-<device>.*.
R=${OUT:-/tmp/out}; mkdir -p $R
if [ -d .whl ]; then
    python -m pip install -q --no-index --find-links .whl msgpack posix_ipc typer prometheus_client xxhash google-re2 uvloop textual hypothesis pytest pytest-timeout 2>&1 | grep -v -i warn | tail -3
    python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warn | tail -2
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt
python -c "import xxhash, torch, triton; print('xxhash', xxhash.VERSION, 'torch', torch.__version__, 'triton', triton.__version__)" | tee $R/versions.txt
echo "== tests"; timeout ${T1:-300} python -m pytest -q -p no:cacheprovider -rs tests/test_gpu_checksum.py tests/test_checksum.py tests/test_copy_engine.py tests/test_integrity.py > $R/pytest-integrity-gpu.txt 2>&1; tail -${TAIL:-12} $R/pytest-integrity-gpu.txt
echo "== bench"; timeout ${T2:-400} python benchmarks/bench_integrity_gpu.py ${SWEEP:+--sweep} --out $R/integrity-gpu > $R/bench-integrity-gpu-log.txt 2>&1; tail -30 $R/bench-integrity-gpu-log.txt
