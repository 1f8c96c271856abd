#!/bin/bash
# The host paths of the engines' data on a GPU machine's CPU, in one go: sharded (TP)
# publish and claim against an older tree (benchmarks/ab_host_paths.py) and the vLLM
# connector's host path with and without checksums (benchmarks/bench_vllm_host.py), then the
# tests of those paths. For a machine with no network: the wheels kvbroker needs beyond the
# host's Python lie in ./.whl (see run_host_round.sh), the older tree in ./.abbase
# (ab_host_paths.py --make-base REV .abbase; its compiled extensions are this tree's, built here).
#
#   OUT=/tmp/out bash benchmarks/run_host_paths.sh COMMIT
#
# The results and logs come back packed in $OUT/host-paths.tgz.
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
SHA=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 KVBROKER_COMMIT=$SHA
PY=${PYTHON:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v mooncake) || exit 1
export PYTHONPATH=/tmp/site
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$R/build.txt" 2>&1 || { tail "$R/build.txt"; exit 1; }
cp kvbroker/_*.so .abbase/kvbroker/
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E "h[0-9]+" | tr A-Z a-z)}
DEV=${DEV:-cpu}
step() { echo "== $1 ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))"; }
step "host paths a/b"
timeout 300 $PY benchmarks/ab_host_paths.py --base .abbase --rounds 3 --repeats 3 \
    --out "$R/host-paths-ab-$DEV-host" > "$R/log-ab.txt" 2>&1; tail -12 "$R/log-ab.txt"
step "vllm host path"
timeout 150 $PY benchmarks/bench_vllm_host.py --tokens 16384 --rounds 3 \
    --out "$R/vllm-host-$DEV-host" > "$R/log-vllm-host.txt" 2>&1; tail -12 "$R/log-vllm-host.txt"
step "tests"
timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/test_tp.py tests/test_copy_engine.py \
    tests/test_vllm_gpu.py > "$R/log-tests.txt" 2>&1; tail -4 "$R/log-tests.txt"
step "done"
tar -C "$O" -czf "$O/host-paths.tgz" r && rm -rf "$R"
