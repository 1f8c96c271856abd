#!/bin/bash
# The GPU figures of docs/performance.md (and the GPU tests) on one CUDA machine, in one of
# two parts (each fits a 10-minute command), everything under $OUT and packed into $OUT/gpu-round-PART.tgz:
#   PART=a: the CUDA tests, bench_integrity_gpu (GpuClient 2 GiB publish/claim/verify), bench_gpu
#   PART=b: the vLLM connector's save/load (NHD, HND), its load_async, check_overlap (8B, bench)
#   PART=ttft: bench_ttft at the 8B shape, twice (its target: an H200)
# Wheels the host lacks (posix_ipc, google-re2, xxhash>=4.1, textual...) come from ./.whl.
#
#   OUT=/tmp/out PART=a bash benchmarks/run_gpu_round.sh COMMIT
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R/r"
SHA=${1:?the commit measured}
PART=${PART:-a}
export PYTHONUNBUFFERED=1 KVBROKER_COMMIT=$SHA
ours=$(ls .whl/*.whl | grep -v mooncake)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ours || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/r/build.txt" 2>&1 || { tail "$R/r/build.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/r/device.txt"
# h100 or h200 (the results files' names), from the GPU's name; DEV=... to choose
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E "h[0-9]+" | tr A-Z a-z)}
DEV=${DEV:-cpu}
step() { echo "== $1 ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))"; }
case $PART in
a)
    step "CUDA tests"
    timeout 280 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_checksum.py \
        tests/test_gpu_integrity.py tests/test_gpu_ring.py tests/test_kernels.py tests/test_ring.py \
        tests/test_integration_transformers.py tests/test_vllm_gpu.py tests/test_bench.py::test_gpu_rows \
        > "$R/r/pytest-gpu.txt" 2>&1; echo "pytest rc=$?"; tail -3 "$R/r/pytest-gpu.txt"
    step "integrity"
    timeout 150 python3 benchmarks/bench_integrity_gpu.py --reps 10 --commit "$SHA" --out "$R/r/integrity-gpu-$DEV" > "$R/r/log-integrity.txt" 2>&1
    grep -E "GpuClient|verify inside" "$R/r/integrity-gpu-$DEV.md"
    step "bench_gpu"
    timeout 150 python3 benchmarks/bench_gpu.py --out "$R/r" --name gpu-$DEV --reps 7 --commit "$SHA" > "$R/r/log-gpu.txt" 2>&1
    grep -E "kvbroker|triton_(gather|scatter) " "$R/r/gpu-$DEV.md" | head -8
    ;;
b)
    for o in NHD HND; do
        step "vLLM $o"
        timeout 100 python3 benchmarks/bench_vllm_gpu.py --out "$R/r" --name vllm-gpu-$DEV-${o,,} --reps 5 --order $o \
            --commit "$SHA" > "$R/r/log-vllm-$o.txt" 2>&1 || true
        tail -4 "$R/r/log-vllm-$o.txt"
    done
    step "vLLM load_async"
    timeout 150 python3 benchmarks/bench_vllm_async_load.py --out "$R/r" --name vllm-async-load-$DEV --reps 3 --commit "$SHA" > "$R/r/log-async.txt" 2>&1; tail -4 "$R/r/log-async.txt"
    step "check_overlap 8b"
    timeout 150 python3 benchmarks/check_overlap.py --size 8b --prompt-len 16384 --rounds 12 --pool-size 8G --control --commit "$SHA" --out "$R/r/check-overlap-8b-$DEV" > "$R/r/log-overlap-8b.txt" 2>&1; tail -3 "$R/r/log-overlap-8b.txt"
    step "check_overlap bench"
    timeout 100 python3 benchmarks/check_overlap.py --size bench --prompt-len 8192 --rounds 40 --control --commit "$SHA" --out "$R/r/check-overlap-bench-$DEV" > "$R/r/log-overlap-bench.txt" 2>&1; tail -3 "$R/r/log-overlap-bench.txt"
    ;;
ttft)
    for run in 1 2; do
        step "ttft 8b run $run"
        timeout 280 python3 benchmarks/bench_ttft.py --device cuda --model 8b --prompt-len 16384 --repeats 6 --pool-size 8G \
            --commit "$SHA" --out "$R/r/ttft-cuda-8b-$DEV-run$run" > "$R/r/log-ttft-$run.txt" 2>&1; tail -6 "$R/r/log-ttft-$run.txt"
    done
    ;;
esac
step done
tar -C "$R" -czf "$R/gpu-round-$PART.tgz" r && rm -rf "$R/r"
