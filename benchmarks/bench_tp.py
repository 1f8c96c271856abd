"""Heterogeneous-TP handoff benchmark (the code lives in kvbroker/_bench/tp_request.py, so that
``kvbroker bench tp`` runs from an installed package); writes benchmarks/results/tp-cpu.json.

    .venv/bin/python benchmarks/bench_tp.py [--repeats 5] [--layout kv-first-HND]
"""

from pathlib import Path

from kvbroker._bench.tp_request import main

if __name__ == "__main__":
    main(default_out=str(Path(__file__).parent / "results" / "tp-cpu.json"))
