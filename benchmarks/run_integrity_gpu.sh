#!/bin/bash
# The GPU host run for issue 17's integrity part, everything under $OUT (or /tmp/out):
# 1. the integrity tests with CUDA (GpuClient publish/claim/verify, publish_shard_cuda, the GPU
#    checksum against the CPU definition, the copy engine, the host path, the GPU data path);
# 2. bench_integrity_gpu.py, in one run: 2 GiB GPU checksum vs a read and a D2D copy; the
#    engine-shaped 2 GiB publish through GpuClient with integrity on vs pinned D2H (target
#    >= 0.9x), claim vs pinned H2D (>= 0.9x), the GPU verify of the claimed object vs a D2D
#    read (>= 0.8x); 32 MiB host put+get over 1 vs N threads vs a multi-threaded memcpy.
# The results file ($OUT/integrity-gpu.md/.json) records commit, machine and command; copy it
# to benchmarks/results/integrity-gpu-<device>.md/.json to commit it.
# The daemon needs msgpack, posix_ipc, google-re2, uvloop...: wheels from .whl/ when the
# checkout carries them (the GPU host has torch/triton but no network).
# Knobs: T1/T2 timeouts (s; 300 + 270 by default, so one 600-s device command holds both), REPS (bench reps, default 30), SWEEP=1 (launch-setting best-of).
R=${OUT:-/tmp/out}; mkdir -p $R
if [ -d .whl ]; then
    python -m pip install -q --no-index --find-links .whl msgpack posix_ipc typer prometheus_client xxhash google-re2 uvloop textual hypothesis pytest pytest-timeout 2>&1 | grep -v -i warn | tail -3
    python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warn | tail -2
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt
git rev-parse HEAD > $R/commit.txt 2>/dev/null || echo "no .git here: pass the commit as COMMIT=..." > $R/commit.txt
python -c "import xxhash, torch, triton; print('xxhash', xxhash.VERSION, 'torch', torch.__version__, 'triton', triton.__version__)" | tee $R/versions.txt
python -c "import msgpack, posix_ipc, re2, uvloop" 2>&1 | sed 's/^/MISSING DAEMON DEPENDENCY (GpuClient tests and bench part will fail): /' | tee -a $R/versions.txt
echo "== tests"
timeout ${T1:-300} python -m pytest -q -p no:cacheprovider -rs \
    tests/test_gpu_integrity.py tests/test_gpu_checksum.py tests/test_gpu.py \
    tests/test_checksum.py tests/test_copy_engine.py tests/test_integrity.py \
    > $R/pytest-integrity-gpu.txt 2>&1; echo "pytest rc=$?"; tail -${TAIL:-15} $R/pytest-integrity-gpu.txt
echo "== bench"
timeout ${T2:-270} python benchmarks/bench_integrity_gpu.py --reps ${REPS:-30} ${SWEEP:+--sweep} \
    ${COMMIT:+--commit $COMMIT} --out $R/integrity-gpu > $R/bench-integrity-gpu-log.txt 2>&1
echo "bench rc=$?"; tail -40 $R/bench-integrity-gpu-log.txt
