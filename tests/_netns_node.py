"""One node of tests/test_fleet.py's network-namespace test, run inside a namespace.

    _netns_node.py serve DIR CERTS ADDRESS PEER_ADDRESS
        a daemon listening on ADDRESS:7070 that serves only PEER_ADDRESS, holding a 16 MiB
        object "x" of seeded bytes; prints "ready", stops on SIGTERM.
    _netns_node.py pull DIR CERTS ADDRESS PEER
        a daemon that claims "x" from PEER (HOST:PORT) and checks it bit for bit; prints
        "bit-exact" and the pull's figures.

CERTS is a folder of kvbroker.testing.peer_certificates with a certificate per mode
("serve.pem", "pull.pem", their keys and "ca.pem").
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from kvbroker.testing import DaemonProcess, drop_leftover_pools

NBYTES = 16 << 20


def main() -> int:
    mode, folder, certs, address, other = sys.argv[1:6]
    os.makedirs(folder, exist_ok=True)
    sock = os.path.join(folder, "kvb.sock")
    data = np.random.default_rng(42).integers(0, 256, NBYTES, dtype=np.uint8)
    env = {
        "UCX_TLS": "tcp",
        "KVBROKER_TRANSFER_NODE": f"ns-{mode}",
        "KVBROKER_TRANSFER_CERT_FILE": os.path.join(certs, f"{mode}.pem"),
        "KVBROKER_TRANSFER_KEY_FILE": os.path.join(certs, f"{mode}.key"),
        "KVBROKER_TRANSFER_CA_FILE": os.path.join(certs, "ca.pem"),
    }
    if mode == "serve":
        env["KVBROKER_TRANSFER_LISTEN"] = f"{address}:7070"
        env["KVBROKER_TRANSFER_PEERS"] = f"{other}:7070"
    else:
        env["KVBROKER_TRANSFER_PEERS"] = other
    d = DaemonProcess(sock, "--pool-size", "64M", env=env, ready_timeout=60)
    try:
        with d.client() as c:
            if mode == "serve":
                c.put("x", {"x": data})
                print("ready", flush=True)
                stop = []
                signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
                while not stop:
                    time.sleep(0.1)
                return 0
            t0 = time.perf_counter()
            with c.claim("x", peer=other, verify=True) as lease:
                dt = time.perf_counter() - t0
                ok = np.array_equal(lease["x"], data)
            st = c.stat().transfer
            print(
                f"{'bit-exact' if ok else 'DIFFERENT'} {NBYTES} bytes in {dt * 1e3:.1f} ms "
                f"from {st.peers[0].node if st.peers else '?'}",
                flush=True,
            )
            return 0 if ok else 1
    finally:
        d.stop()
        drop_leftover_pools(sock)


if __name__ == "__main__":
    sys.exit(main())
