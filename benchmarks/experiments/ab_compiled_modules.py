"""Would compiling the hot modules as they are make a small put+get faster? Measured, alternated.

Copies this tree's ``kvbroker/`` (with its built C extensions) to a scratch directory, compiles
the daemon's and the client's hot modules there with Cython in pure-Python mode (no type
declarations: ``annotation_typing=False``, ``binding=True``, so the modules behave as
written), then alternates ``probe_protocol_floor.py`` (one round each: a 256 KiB put+get
through the ``Client`` and as the bare protocol, against a private daemon of the same tree)
between the interpreted tree and the compiled one, ``--rounds`` times.

    pip install cython setuptools    # the compiler is needed for this probe only
    python benchmarks/experiments/ab_compiled_modules.py [--reps 3000] [--rounds 4] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from kvbroker._bench._common import invocation, machine_info, measured_commit  # noqa: E402
from kvbroker._bench._common import median  # noqa: E402

MODULES = [
    "_server/connection.py",
    "_server/broker.py",
    "_server/handlers.py",
    "_server/arenas.py",
    "_server/journal.py",
    "_server/state.py",
    "_server/allocator.py",
    "_server/accounts.py",
    "_server/pages.py",
    "_server/daemon.py",
    "_server/policy.py",
    "_server/prefix_leases.py",
    "_wire/protocol.py",
    "_wire/checksum.py",
    "_wire/objects.py",
    "_client/client.py",
    "_client/arena.py",
    "_client/session.py",
    "_client/framing.py",
    "_client/transport.py",
    "_client/leases.py",
    "_client/copy.py",
    "_client/engine.py",
    "_client/integrity.py",
    "_client/mappings.py",
    "_client/ops.py",
    "_cpu.py",
]
_P50 = re.compile(r"median of the rounds' p50: client ([\d.]+) us, bare ([\d.]+) us")


def _compile(tree: str) -> None:
    from Cython.Build import cythonize
    from setuptools import Extension
    from setuptools.dist import Distribution

    sources = [os.path.join("kvbroker", m) for m in MODULES]
    exts = [Extension(s[:-3].replace(os.sep, "."), [s]) for s in sources]
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        built = cythonize(
            exts,
            quiet=True,
            nthreads=os.cpu_count() or 1,
            compiler_directives={"language_level": 3, "annotation_typing": False, "binding": True},
        )
        dist = Distribution({"ext_modules": built, "script_args": ["build_ext", "--inplace"]})
        dist.parse_command_line()
        dist.run_commands()
    finally:
        os.chdir(cwd)
    missing = [
        m
        for m in MODULES
        if not any(
            f.startswith(os.path.basename(m)[:-3] + ".") and f.endswith(".so")
            for f in os.listdir(os.path.join(tree, "kvbroker", os.path.dirname(m)))
        )
    ]
    if missing:
        raise SystemExit(f"not compiled: {missing}")


def _probe(tree: str, reps: int) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "probe_protocol_floor.py"),
            "--reps",
            str(reps),
            "--rounds",
            "1",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = _P50.search(out)
    if m is None:
        raise SystemExit(f"unexpected probe output:\n{out}")
    return float(m.group(1)), float(m.group(2))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="kvb-compiled-")
    try:
        compiled = os.path.join(scratch, "tree")
        os.makedirs(compiled)
        shutil.copytree(
            os.path.join(ROOT, "kvbroker"),
            os.path.join(compiled, "kvbroker"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        _compile(compiled)
        rows = []
        for r in range(args.rounds):
            for kind, tree in (("interpreted", ROOT), ("compiled", compiled)):
                client, bare = _probe(tree, args.reps)
                rows.append(
                    {"round": r + 1, "tree": kind, "client_p50_us": client, "bare_p50_us": bare}
                )
                print(
                    f"round {r + 1} {kind}: client {client:.1f} us, bare {bare:.1f} us", flush=True
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def med(kind, key):
        return median([x[key] for x in rows if x["tree"] == kind])

    summary = {
        k: {"client_p50_us": med(k, "client_p50_us"), "bare_p50_us": med(k, "bare_p50_us")}
        for k in ("interpreted", "compiled")
    }
    ratio = {
        key: median([c[key] / i[key] for i, c in zip(rows[0::2], rows[1::2], strict=True)])
        for key in ("client_p50_us", "bare_p50_us")
    }
    import Cython

    result = {
        "benchmark": "ab_compiled_modules",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "cython": Cython.__version__,
        "modules": MODULES,
        "reps": args.reps,
        "rounds": rows,
        "median": summary,
        "compiled_over_interpreted": ratio,
    }
    print(json.dumps({"median": summary, "compiled_over_interpreted": ratio}, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        m = result["machine"]
        lines = [
            f"# The hot modules compiled as they are (Cython {Cython.__version__}) against "
            f"interpreted, 256 KiB put+get ({m.get('cpu')}, {m.get('cores')} cores, Python "
            f"{m.get('python')})",
            "",
            f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min', 0):.2f}; "
            f"`{result['command']}`; {len(MODULES)} modules compiled (listed in the JSON), "
            "each tree's daemon and client its own.",
            "",
            "| round | interpreted: Client / bare µs | compiled: Client / bare µs |",
            "|---|---|---|",
        ]
        for i, c in zip(rows[0::2], rows[1::2], strict=True):
            lines.append(
                f"| {i['round']} | {i['client_p50_us']:.1f} / {i['bare_p50_us']:.1f} | "
                f"{c['client_p50_us']:.1f} / {c['bare_p50_us']:.1f} |"
            )
        lines += [
            "",
            f"Compiled over interpreted, median of the rounds' ratios: Client "
            f"{ratio['client_p50_us']:.2f}×, bare protocol {ratio['bare_p50_us']:.2f}× "
            "(above 1: the compiled modules are slower).",
        ]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
