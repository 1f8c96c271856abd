#!/bin/bash
# The host-side figures of a GPU machine's CPU in one go (a GPU host's CPU rows of docs/performance.md):
# the copy engine against memcpy, kvbroker beside Mooncake Store, the requests of a put+get one
# by one, the control plane, and the protocol floor. For a machine with no network: the wheels
# kvbroker needs beyond the host's Python (posix_ipc, google-re2, xxhash>=4.1, textual and its
# deps) and, for Mooncake, its wheel and the Debian packages libibverbs1, libnl-3-200 and
# libnl-route-3-200 lie in ./.whl and ./.whl/debs (docs/operating.md, "Comparing with Mooncake").
#
#   OUT=/tmp/out bash benchmarks/run_host_round.sh [COMMIT]
#
# COMMIT is recorded in each results file (default: git's HEAD where there is a .git); the
# results and logs come back packed in $OUT/host-round.tgz.
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
SHA=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 KVBROKER_COMMIT=$SHA
PY=${PYTHON:-python3}
ours=$(ls .whl/*.whl | grep -v mooncake)
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ours || exit 1
export PYTHONPATH=/tmp/site
# editable: kvbroker.cli and kvbroker.tui are the top-level cli/ and tui/ folders
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$R/build.txt" 2>&1 || { tail "$R/build.txt"; exit 1; }
$PY -c "from kvbroker._client import engine as E; print('C loops', E.NATIVE, 'one pass', E.fused_loop())"
if ls .whl/mooncake*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/mc .whl/mooncake*.whl || exit 1
    mkdir -p /tmp/mcdeb && for d in .whl/debs/*.deb; do dpkg -x "$d" /tmp/mcdeb/root; done
    printf '#!/bin/sh\nPYTHONPATH=/tmp/mc exec %s "$@"\n' "$(command -v $PY)" > /tmp/mcpy
    chmod +x /tmp/mcpy
    a=$(uname -m)-linux-gnu
    export LD_LIBRARY_PATH=/tmp/mcdeb/root/usr/lib/$a:/tmp/mcdeb/root/lib/$a${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    PEER="--mooncake-python /tmp/mcpy"
else
    PEER=""
fi
# h100 or h200 (the results files' names), from the GPU's name; DEV=... to choose
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E "h[0-9]+" | tr A-Z a-z)}
DEV=${DEV:-cpu}
step() { echo "== $1 ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))"; }
[ -n "${SKIP_COPY:-}" ] || {
step "host copy"
timeout 150 $PY benchmarks/profile_host_copy.py --size 32M --threads 8 --rounds 6 --out "$R/host-copy-$DEV-host" > "$R/log-host-copy.txt" 2>&1; tail -22 "$R/log-host-copy.txt"; }
step "peer"
timeout 240 $PY -m kvbroker bench peer $PEER --rounds 3 --json-out "$R/peer-$DEV-host.json" > "$R/log-peer.txt" 2>&1; tail -25 "$R/log-peer.txt"
step "put+get phases"
timeout 120 $PY benchmarks/profile_put_get.py --sizes 256K,32M --reps 60 --rounds 2 --out "$R/put-get-phases-$DEV-host" > "$R/log-phases.txt" 2>&1; tail -12 "$R/log-phases.txt"
if [ -z "${SKIP_RPC:-}" ]; then
step "rpc"
timeout 120 $PY -m kvbroker bench rpc --clients 1,4,16 --seconds 3 --json-out "$R/rpc-$DEV-host.json" > "$R/log-rpc.txt" 2>&1; tail -12 "$R/log-rpc.txt"
KVBROKER_READ_REPLICAS=0 timeout 120 $PY -m kvbroker bench rpc --clients 1,4,16 --seconds 3 --json-out "$R/rpc-$DEV-host-no-replicas.json" > "$R/log-rpc-no-replicas.txt" 2>&1; tail -8 "$R/log-rpc-no-replicas.txt"
step "protocol floor"
timeout 120 $PY benchmarks/probe_protocol_floor.py --reps 3000 --rounds 4 --out "$R/protocol-floor-$DEV-host" > "$R/log-floor.txt" 2>&1; tail -8 "$R/log-floor.txt"
fi
step "done"
tar -C "$O" -czf "$O/host-round.tgz" r && rm -rf "$R"
