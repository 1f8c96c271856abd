"""Sharded (TP) publishes and claims on the host, this code against an older tree, side by
side: the paged gather/scatter and the publish's hashing on the copy engine's threads
(``CopyEngine.run_jobs``) against one thread and a hash at seal.

One private daemon (this tree's: only client code differs); each round runs ``kvbroker bench
tp``'s measurement (:mod:`kvbroker._bench.tp_request`: one request of 256 MiB of K+V, P
prefill ranks publish, D decode ranks claim, for P=D=1, P=4→1, P=1→4 and both decode
layouts) once with each client tree, alternated, each in a fresh process. The base tree is
a ``kvbroker`` package directory of an older commit (``--make-base REV DIR`` writes one with
``git archive`` and copies this tree's compiled extensions beside it; a device machine
without git gets it carried).

    python benchmarks/ab_tp_threads.py --make-base c343838 .abbase
    python benchmarks/ab_tp_threads.py --base .abbase [--rounds 3] [--repeats 3] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _make_base(rev: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "kvbroker"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "kvbroker", "*.so")):
        shutil.copy(so, os.path.join(out, "kvbroker"))
    with open(os.path.join(out, "REV"), "w") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True,
                               capture_output=True, text=True).stdout)  # fmt: skip


def _one(tree: str, socket_path: str, repeats: int) -> None:
    """In a fresh process: the measurement with ``tree``'s kvbroker (empty: this tree's)."""
    if tree:
        sys.path.insert(0, os.path.abspath(tree))
    import kvbroker
    from kvbroker._bench import tp
    from kvbroker._client.engine import default_engine

    result = tp.run(socket_path, repeats)
    engine = default_engine()
    print(json.dumps({"package": kvbroker.__file__, "threads": engine.threads,
                      "gated": engine.split_while is not None,
                      "rows": [{k: r[k] for k in ("layout", "P", "D", "claim_GBps",
                                                  "publish_GBps")} for r in result.rows]}))  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-base", nargs=2, metavar=("REV", "DIR"))
    ap.add_argument("--base", metavar="DIR", help="a tree made by --make-base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    ap.add_argument("--one", nargs=3, metavar=("TREE", "SOCKET", "REPEATS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.make_base:
        _make_base(*a.make_base)
        return 0
    if a.one:
        _one(a.one[0], a.one[1], int(a.one[2]))
        return 0
    if not a.base:
        ap.error("--base DIR (a tree made by --make-base) is required")

    from kvbroker._bench._common import invocation, machine_info, measured_commit, median
    from kvbroker._bench._common import spawned_daemon

    with open(os.path.join(a.base, "REV")) as f:
        base_rev = f.read().strip()
    variants = {"this code": "", f"base {base_rev}": a.base}
    runs = []
    with spawned_daemon("2G") as sock:
        for rnd in range(1, a.rounds + 1):
            for name, tree in variants.items():
                out = subprocess.run([sys.executable, __file__, "--one", tree, sock,
                                      str(a.repeats)], check=True, capture_output=True,
                                     text=True).stdout  # fmt: skip
                got = json.loads(out.strip().splitlines()[-1])
                if tree and not got["package"].startswith(os.path.abspath(tree)):
                    raise RuntimeError(f"the base run imported {got['package']}")
                runs.append({"round": rnd, "variant": name, **got})
                print(f"round {rnd} {name}: " + "; ".join(
                    f"{r['layout']} P={r['P']}→{r['D']} claim {r['claim_GBps']:.2f} publish "
                    f"{r['publish_GBps']:.2f} GB/s" for r in got["rows"]), flush=True)  # fmt: skip
    base, new = list(variants)[1], list(variants)[0]
    configs = [(r["layout"], r["P"], r["D"]) for r in runs[0]["rows"]]
    summary = []
    for cfg in configs:
        entry = {"layout": cfg[0], "P": cfg[1], "D": cfg[2]}
        for what in ("claim_GBps", "publish_GBps"):
            per_round = []
            for rnd in range(1, a.rounds + 1):
                value = {}
                for run in runs:
                    if run["round"] == rnd:
                        row = next(r for r in run["rows"] if (r["layout"], r["P"], r["D"]) == cfg)
                        value[run["variant"]] = row[what]
                per_round.append(value[new] / value[base])
            entry[what] = {"this code": median([r[what] for run in runs if run["variant"] == new
                                                for r in run["rows"]
                                                if (r["layout"], r["P"], r["D"]) == cfg]),
                           "base": median([r[what] for run in runs if run["variant"] == base
                                           for r in run["rows"]
                                           if (r["layout"], r["P"], r["D"]) == cfg]),
                           "x_base_per_round": per_round}  # fmt: skip
        summary.append(entry)
    result = {"benchmark": "ab_tp_threads", "commit": measured_commit(), "base": base_rev,
              "command": invocation(), "machine": machine_info(), "rounds": a.rounds,
              "repeats": a.repeats, "threads": runs[0]["threads"], "gated": runs[0]["gated"],
              "runs": runs, "summary": summary}  # fmt: skip
    md = markdown(result)
    print(md)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(md)
    return 0


def markdown(result: dict) -> str:
    from kvbroker._bench._common import median

    m = result["machine"]

    def span(v):
        return f"{int(median(v) * 100) / 100:.2f} ({min(v):.2f}–{max(v):.2f})"

    out = [f"# Sharded publish and claim on the host: this code against {result['base']} "
           f"({m.get('cpu')}, {m.get('cores')} cores)", "",
           f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min'):.2f}; "
           f"`{result['command']}`; the copy engine on {result['threads']} thread(s)"
           f"{' (gated: a second only while a CPU is left idle)' if result['gated'] else ''}; "
           f"{result['rounds']} rounds alternated, each the median of {result['repeats']} "
           "requests of 256 MiB.", "",
           "| decode layout | P→D | claim GB/s this / base | claim × base per round: median "
           "(range) | publish GB/s this / base | publish × base per round |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for e in result["summary"]:
        c, p = e["claim_GBps"], e["publish_GBps"]
        out.append(f"| {e['layout']} | {e['P']}→{e['D']} | {c['this code']:.2f} / {c['base']:.2f}"
                   f" | {span(c['x_base_per_round'])} | {p['this code']:.2f} / {p['base']:.2f} | "
                   f"{span(p['x_base_per_round'])} |")  # fmt: skip
    out += ["", "× above 1: faster than the base; ratios cut to two decimals."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
