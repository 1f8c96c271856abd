"""The CLI as operators and newcomers meet it (issue 19, issue 16 item 12): exit codes, one-line
errors, escaped control characters, whole keys, ls/show/evict/stat additions, help texts."""

import json
import os
import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from kvbroker.cli import app

runner = CliRunner()


def run(*args, env=None, input=None):
    return runner.invoke(app, [str(a) for a in args], env=env, input=input)


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


@pytest.fixture
def loaded(daemon):
    with daemon.client() as c:
        c.put(
            "req-1",
            {"past_key.0": b"k" * 5000, "past_value.0": b"v" * 5000},
            namespace="pd",
            meta={"tokens": 812},
        )
        c.put("req-2", {"past_key.0": b"k" * 100}, namespace="pd")
        c.put("keep-4", {"x": b"x" * 10})
    return daemon


# -- exit codes and errors -----------------------------------------------------------------
def test_evict_missing_key_exits_1_with_and_without_json(loaded):
    s = loaded.socket_path
    assert run("evict", "nokey", "-s", s).exit_code == 1
    r = run("evict", "nokey", "--json", "-s", s)
    assert r.exit_code == 1
    assert json.loads(r.stdout)["count"] == 0
    assert "no object 'nokey'" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("ls", "--match", "("),
        ("evict", "--match", "("),
        ("evict", "--match-buffers", "("),
        ("verify", "--match", "("),
    ],
)
def test_bad_regex_is_a_one_line_usage_error(loaded, args):
    r = run(*args, "-s", loaded.socket_path)
    assert r.exit_code == 2, r.output
    assert "bad_request" not in r.output and "bad regex" in r.stderr
    assert len(lines_of(r.stderr)) == 1 and r.stderr.startswith("kvbroker: --match")


def test_usage_errors_are_one_line(loaded):
    for args in (
        ["evict", "--older-than", "soon"],
        ["ls", "--limit", "x"],
        ["nosuch"],
        ["ls", "--sort", "colour"],
        ["evict"],
    ):
        r = run(*args, "-s", loaded.socket_path) if args != ["nosuch"] else run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert len(lines_of(r.stderr)) == 1, (args, r.stderr)
        assert "--help" in r.stderr and "Usage:" not in r.stderr


@pytest.mark.parametrize("group", [[], ["bench"]])
def test_a_group_without_a_command_prints_its_help_whole(group):
    """`kvbroker` (or `kvbroker bench`) alone: the help as Click lays it out, a command a
    line, not folded into one line of usage error."""
    r = run(*group)
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert lines[0] == f"Usage: {' '.join(['kvbroker', *group])} [OPTIONS] COMMAND [ARGS]..."
    commands = lines[lines.index("Commands:") + 1 :]
    named = {line.split()[0] for line in commands if line.strip()}
    assert ({"serve", "stat", "ls", "evict", "tui"} if not group else {"transfer", "peer"}) <= named


def test_every_option_of_every_command_names_what_it_takes():
    """No --help shows an option with Click's bare type for its value (`--sizes <str>`): each
    says what to give (SIZE, N,N,..., HOST:PORT...)."""
    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands]
    commands += [["bench", name] for name in group.commands["bench"].commands]
    for words in commands:
        r = run(*words, "--help")
        assert r.exit_code == 0, (words, r.output)
        bare = re.search(r"^ +(-\w, )?--[\w-]+ <(str|int|float|path)>", r.output, re.M)
        assert not bare, (words, bare.group(0))
    assert len(commands) > 15


def test_conflicting_selectors_are_refused(loaded):
    s = loaded.socket_path
    for args in (["keep-4", "--all"], ["--all", "--namespace", "pd"], ["req-1", "-m", "req"]):
        r = run("evict", *args, "-s", s)
        assert r.exit_code == 2, (args, r.output)
        assert len(lines_of(r.stderr)) == 1
    assert json.loads(run("stat", "--json", "-s", s).stdout)["objects"] == 3  # nothing gone


def test_stat_refused_for_max_connections_is_one_line(make_daemon):
    d = make_daemon("--pool-size", "16M", "--page-size", "4K", "--max-connections", "1")
    with d.client():
        r = subprocess.run(
            [sys.executable, "-m", "kvbroker", "stat", "-s", d.socket_path],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert len(lines_of(r.stderr)) == 1 and r.stderr.startswith("kvbroker: ")
    assert "connection" in r.stderr


def test_control_characters_are_escaped_everywhere(daemon):
    evil = "evil\x1b]0;pwned\x07\nforged-row\u2028x"
    with daemon.client() as c:
        c.put(evil, {"buf\x1b[2J": b"x" * 10}, namespace="ns\x1b[31m", meta={"m": "a\x1b"})
    s = daemon.socket_path
    outputs = [
        run("ls", "-s", s),
        run("show", evil, "-s", s),
        run("stat", "-s", s),
        run("verify", "-s", s),
        run("evict", evil, "--dry-run", "-s", s),
        run("show", "nothing\x1b[2J", "-s", s),
        run("evict", "nothing\x1b", "-s", s),
    ]
    for r in outputs:
        for text in (r.stdout, r.stderr):
            assert "\x1b" not in text and "\x07" not in text and "\u2028" not in text, text
            assert "forged-row" not in text or "\\nforged-row" in text
    ls_rows = lines_of(outputs[0].stdout)
    assert len(ls_rows) == 2 and "\\x1b]0;pwned\\x07\\nforged-row" in ls_rows[1]


# -- ls ------------------------------------------------------------------------------------
def test_ls_says_when_it_stops_at_the_limit_and_limit_0_lists_all(daemon):
    with daemon.client() as c:
        for i in range(5):
            c.put(f"obj-{i}", {"x": b"x"})
    s = daemon.socket_path
    r = run("ls", "--limit", "2", "--no-header", "-s", s)
    assert r.exit_code == 0 and len(lines_of(r.stdout)) == 2
    assert "more match" in r.stderr and "--limit 2" in r.stderr
    r = run("ls", "--limit", "0", "--no-header", "-s", s)
    assert len(lines_of(r.stdout)) == 5 and r.stderr == ""
    r = run("ls", "--limit", "5", "--json", "-s", s)
    assert len(json.loads(r.stdout)) == 5 and r.stderr == ""


def test_ls_never_cuts_keys_silently(daemon):
    key = "prefix/" + "a" * 60 + "/tail-that-matters"
    ns = "a-namespace-longer-than-fifteen"
    with daemon.client() as c:
        c.put(key, {"x": b"x"}, namespace=ns)
    s = daemon.socket_path
    piped = run("ls", "-s", s)  # not a terminal, no COLUMNS: names whole
    assert key in piped.stdout and ns in piped.stdout
    narrow = run("ls", "-s", s, env={"COLUMNS": "80"})
    row = lines_of(narrow.stdout)[1]
    assert key not in row and "…" in row and len(row) <= 80
    wide = run("ls", "--wide", "-s", s, env={"COLUMNS": "80"})
    assert key in wide.stdout and ns in wide.stdout
    assert json.loads(run("ls", "--json", "-s", s, env={"COLUMNS": "80"}).stdout)[0]["key"] == key


def test_ls_sort_reverse_and_no_header(loaded):
    s = loaded.socket_path
    keys = [line.split()[1] for line in lines_of(run("ls", "--sort", "size", "-s", s).stdout)[1:]]
    assert keys == ["req-1", "req-2", "keep-4"]  # largest first
    r = run("ls", "--sort", "size", "--reverse", "--no-header", "-s", s)
    assert [line.split()[1] for line in lines_of(r.stdout)] == ["keep-4", "req-2", "req-1"]
    r = run("ls", "--sort", "key", "--json", "-s", s)
    assert [o["key"] for o in json.loads(r.stdout)] == ["keep-4", "req-1", "req-2"]


def test_ls_sort_and_reverse_order_every_match_before_the_limit(daemon):
    """--sort size --limit 2 lists the two largest objects, not the first two sealed in
    size order; --reverse alone the newest sealed. Past the daemon's 10,000-object reply too:
    the largest was sealed last."""
    with daemon.client(map_pools=False) as c:
        _seal_many_objects(c, 10_003)  # one byte each, o000000 ... o010002
        for i, n in enumerate((300, 100, 200)):
            c.put(f"big-{i}", {"x": b"x" * n}, namespace="bulk")
    s = daemon.socket_path

    def keys(*args):
        r = run("ls", "--no-header", "-n", "bulk", "-s", s, *args)
        assert r.exit_code == 0, r.output
        return [line.split()[1] for line in lines_of(r.stdout)], r.stderr

    listed, note = keys("--sort", "size", "--limit", "2")
    assert listed == ["big-0", "big-2"] and "more match" in note and "--limit 2" in note
    listed, _ = keys("--sort", "size", "--reverse", "--limit", "2")
    assert listed == ["o000000", "o000001"]  # smallest first; ties in the order sealed
    listed, note = keys("--reverse", "--limit", "3")
    assert listed == ["big-2", "big-1", "big-0"] and "more match" in note
    listed, note = keys("--sort", "size", "--limit", "0")
    assert listed[:3] == ["big-0", "big-2", "big-1"] and len(listed) == 10_006 and note == ""
    listed, note = keys("--sort", "size", "--limit", "10006")
    assert len(listed) == 10_006 and note == ""


def test_ls_json_has_no_made_up_checksums(loaded):
    # `list` does not carry checksums: ls --json must not claim "null" (= sealed without).
    for obj in json.loads(run("ls", "--json", "-s", loaded.socket_path).stdout):
        assert "checksums" not in obj
    shown = json.loads(run("show", "req-1", "--json", "-s", loaded.socket_path).stdout)
    assert set(shown[0]["checksums"]) == {"past_key.0", "past_value.0"}


# -- show, stat --watch, evict --all -----------------------------------------------------------
def test_show_one_object(loaded):
    s = loaded.socket_path
    with loaded.client() as c, c.claim("req-1", namespace="pd"):
        r = run("show", "req-1", "-s", s)  # in any namespace
        assert r.exit_code == 0, r.output
        text = r.stdout
        assert text.startswith("pd/req-1")
        assert "10000 bytes" in text and "2 buffer(s)" in text and "readers     1" in text
        assert '"tokens": 812' in text
        assert "past_key.0" in text and "past_value.0" in text
        assert re.search(r"#\d+ read by session \d+", text)
        data = json.loads(run("show", "req-1", "-n", "pd", "--json", "-s", s).stdout)
        assert data[0]["meta"] == {"tokens": 812} and data[0]["leases"][0]["kind"] == "read"
    r = run("show", "req-1", "-n", "default", "-s", s)
    assert r.exit_code == 1 and "no object" in r.stderr
    assert run("show", "keep-4", "-s", s).stdout.startswith("default/keep-4")


def test_stat_watch_prints_snapshots_until_count(loaded):
    r = run(
        "stat", "--watch", "--interval", "0.1", "--count", "3", "--json", "-s", loaded.socket_path
    )
    assert r.exit_code == 0, r.output
    snaps = [json.loads(line) for line in lines_of(r.stdout)]
    assert len(snaps) == 3 and all(s["objects"] == 3 for s in snaps)
    r = run("stat", "--watch", "-i", "0.1", "--count", "2", "-s", loaded.socket_path)
    assert r.stdout.count("POOL") == 2 and "\x1b[2J" not in r.stdout  # no clearing in a pipe


def test_evict_all_asks_on_a_terminal(loaded, monkeypatch):
    monkeypatch.setattr("kvbroker.cli._objects._confirm_on_terminal", lambda: True)
    s = loaded.socket_path
    r = run("evict", "--all", "-s", s, input="n\n")
    assert r.exit_code == 1 and "nothing evicted" in r.stderr
    assert json.loads(run("stat", "--json", "-s", s).stdout)["objects"] == 3
    r = run("evict", "--all", "--dry-run", "-s", s)  # a dry run never asks
    assert r.exit_code == 0 and "would evict 3" in r.stdout
    r = run("evict", "--all", "-s", s, input="y\n")
    assert r.exit_code == 0 and "evicted 3 object" in r.stdout
    with loaded.client() as c:
        c.put("again", {"x": b"x"})
    r = run("evict", "--all", "--yes", "-s", s)  # no question asked: no input needed
    assert r.exit_code == 0 and "evicted 1 object" in r.stdout


# -- help, version, completion -------------------------------------------------------------
def test_version():
    from kvbroker import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"kvbroker {__version__}"


@pytest.mark.parametrize(
    "command",
    [
        "serve",
        "ls",
        "evict",
        "stat",
        "show",
        "verify",
        "doctor",
        "bench rpc",
        "bench tp",
        "bench gpu",
    ],
)
def test_help_fits_80_columns_and_names_no_repo_paths(command):
    r = run(*command.split(), "--help", env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.stdout.splitlines()), r.stdout
    assert "<bool>" not in r.stdout
    assert "benchmarks/" not in r.stdout
    if command == "serve":
        for name in ("--restart-quarantine", "--keep-pools-on-exit", "--drop-pools-on-exit"):
            assert name in r.stdout


def test_every_namespace_option_has_help():
    for command in ("ls", "evict", "show", "verify"):
        out = run(command, "--help", env={"COLUMNS": "100"}).stdout
        line = next(x for x in out.splitlines() if "-n, --namespace NS" in x)
        assert len(line.split("NS", 1)[1].strip()) > 10, line


def test_socket_default_in_help_is_the_real_one(monkeypatch):
    from kvbroker.cli._common import user_default_socket

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert user_default_socket() == "/run/kvbroker/kvbroker.sock"
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    assert user_default_socket() == "/tmp/kvbroker-1234.sock"
    monkeypatch.undo()
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_SOCKET"}
    env["COLUMNS"] = "200"
    r = subprocess.run(
        [sys.executable, "-m", "kvbroker", "stat", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "$XDG_RUNTIME_DIR" not in r.stdout
    assert f"default: ({user_default_socket()})" in " ".join(r.stdout.split()), r.stdout


def test_shell_completion():
    import shutil

    exe = shutil.which("kvbroker", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the kvbroker script is not installed beside this Python")

    def complete(words: str, cword: int, kind: str = "complete_bash") -> str:
        env = {
            **os.environ,
            "_KVBROKER_COMPLETE": kind,
            "COMP_WORDS": words,
            "COMP_CWORD": str(cword),
        }
        return subprocess.run([exe], env=env, capture_output=True, text=True, timeout=30).stdout

    assert "_kvbroker_completion" in complete("", 0, "source_bash")  # the script to source
    assert complete("kvbroker st", 1).split() == ["stat"]
    assert {"--sort", "--socket"} <= set(complete("kvbroker ls --so", 2).split())
    assert "--install-completion" in run("--help").stdout


# -- bench against a running daemon ----------------------------------------------------------
def test_bench_rpc_honours_KVBROKER_SOCKET_and_leaves_nothing_behind(loaded):
    s = loaded.socket_path
    before = json.loads(run("stat", "--json", "-s", s).stdout)
    keys = sorted(
        (o["namespace"], o["key"]) for o in json.loads(run("ls", "--json", "-s", s).stdout)
    )
    r = run("bench", "rpc", "--clients", "1", "--seconds", "0.2", env={"KVBROKER_SOCKET": s})
    assert r.exit_code == 0, r.output
    after = json.loads(run("stat", "--json", "-s", s).stdout)
    # it measured this daemon (its lookups are counted here), and left no object behind
    assert after["counters"]["requests"] > before["counters"]["requests"] + 10
    assert after["objects"] == before["objects"] == 3
    now = sorted(
        (o["namespace"], o["key"]) for o in json.loads(run("ls", "--json", "-s", s).stdout)
    )
    assert now == keys


# -- issue 19 phase B: ping, doctor's daemon check, show from lookup, ls past 10,000 ---------
def test_ping_answers_with_the_daemons_pid_and_version(daemon):
    from kvbroker import __version__

    s = daemon.socket_path
    r = run("ping", "-c", "3", "-i", "0", "-s", s)
    assert r.exit_code == 0, r.output
    pongs = [line for line in lines_of(r.stdout) if line.startswith("pong")]
    assert len(pongs) == 3 and f"kvbroker {__version__} (pid {daemon.proc.pid})" in pongs[0]
    assert re.search(r"3 ping\(s\): min/avg/max [\d.]+/[\d.]+/[\d.]+ ms", r.stdout)
    data = json.loads(run("ping", "--json", "-s", s).stdout)
    assert data["server_pid"] == daemon.proc.pid and len(data["rtt_ms"]) == 1
    with daemon.client(map_pools=False) as c:
        assert 0 < c.ping() < 5
        assert c.ops.ping()["server_pid"] == daemon.proc.pid


def test_ping_and_doctor_without_a_daemon(tmp_path):
    r = run("ping", "-s", tmp_path / "none.sock")
    assert r.exit_code == 3 and "no kvbroker daemon" in r.stderr
    r = run("doctor", "--socket", tmp_path / "none.sock", "--json", env={"KVBROKER_CONFIG": ""})
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["daemon"]["status"] == "warn" and "none.sock" in checks["daemon"]["detail"]
    assert "kvbroker serve" in checks["daemon"]["fix"]
    assert checks["socket unit"]["status"] in ("ok", "warn", "fail", "skip")


def test_doctor_says_the_daemon_answers(daemon):
    r = run("doctor", "--socket", daemon.socket_path, env={"KVBROKER_CONFIG": ""})
    line = next(line for line in r.stdout.splitlines() if " daemon " in line)
    assert line.startswith("OK") and f"(pid {daemon.proc.pid}) answers on" in line, r.stdout


def test_doctor_runs_the_socket_unit_check(tmp_path, monkeypatch):
    from kvbroker._server import doctor
    from kvbroker._server.config import DaemonConfig

    unit = tmp_path / "kvbroker.socket"
    unit.write_text("[Socket]\nListenStream=/run/kvbroker/kvbroker.sock\n")
    monkeypatch.setattr("kvbroker._unitcheck.UNIT_PATHS", (str(unit),))
    bad = doctor.check_socket_unit(DaemonConfig(socket_path="/tmp/elsewhere.sock"))
    assert bad.status == "fail" and "/run/kvbroker/kvbroker.sock" in bad.detail and bad.fix
    assert any(c.name == "socket unit" for c in doctor.run_checks(DaemonConfig()))


def test_show_prints_each_buffer_size_and_the_consumers_left(daemon):
    s = daemon.socket_path
    with daemon.client() as c:
        c.put("multi", {"k": b"k" * 3000, "v": b"v" * 1234, "empty": b""}, consumers=3)
        c.get("multi", consume=True)  # one of three consume-claims released
        info = c.lookup("multi")
    assert info.buffer_sizes == {"k": 3000, "v": 1234, "empty": 0} and info.consumers == 2
    r = run("show", "multi", "-s", s)
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[7:11]}
    assert rows["k"][0] == "3000" and rows["v"][0] == "1234" and rows["empty"][0] == "0"
    assert all(re.fullmatch(r"xxh3c?:[0-9a-f]{16}", rows[n][1]) for n in ("k", "v", "empty"))
    assert "consumers   2 consume-claim(s) left" in r.stdout
    data = json.loads(run("show", "multi", "--json", "-s", s).stdout)[0]
    assert data["buffer_sizes"] == {"k": 3000, "v": 1234, "empty": 0} and data["consumers"] == 2
    # a key holding regex syntax, in a namespace stat would not name: found exactly
    with daemon.client() as c:
        c.put("a.b(c)*", {"x": b"x"}, namespace="odd ns")
        c.put("aXb(c)", {"x": b"x"}, namespace="other")
    r = run("show", "a.b(c)*", "-s", s)
    assert r.exit_code == 0 and r.stdout.startswith("odd ns/a.b(c)*") and "other/" not in r.stdout


def _seal_many_objects(client, n: int, namespace: str = "bulk") -> None:
    for first in range(0, n, 2000):
        blocks = [
            {"key": f"o{i:06d}", "parent": None, "buffers": {"x": 1}}
            for i in range(first, min(n, first + 2000))
        ]
        leases = [
            r["lease"] for r in client.ops.reserve_blocks(blocks, namespace=namespace)["results"]
        ]
        client.ops.seal_many(leases)


def test_ls_limit_0_lists_past_the_daemons_reply_cap(daemon):
    s = daemon.socket_path
    with daemon.client(map_pools=False) as c:
        _seal_many_objects(c, 10_050)
        listing = c.list(namespace="bulk")
        assert len(listing) == 10_050 and not listing.truncated
        some = c.list(namespace="bulk", limit=10_020)
        assert len(some) == 10_020 and some.truncated
        pages = list(c.list_pages(namespace="bulk", page_size=4000))
        assert [len(p) for p in pages] == [4000, 4000, 2050]
        assert sorted(o.key for p in pages for o in p) == [f"o{i:06d}" for i in range(10_050)]
    r = run("ls", "--limit", "0", "--no-header", "-n", "bulk", "-s", s)
    assert r.exit_code == 0 and r.stderr == ""
    assert len(lines_of(r.stdout)) == 10_050
    r = run("ls", "--limit", "10010", "--no-header", "-s", s)
    assert len(lines_of(r.stdout)) == 10_010 and "--limit 10010 reached" in r.stderr


def test_list_pages_list_each_object_once_while_others_come_and_go(daemon):
    with daemon.client(map_pools=False) as c:
        for i in range(30):
            c.put(f"k{i:02d}", {"x": b"x"})
        seen = []
        for n, page in enumerate(c.list_pages(page_size=7)):
            seen += [o.key for o in page]
            c.evict(f"k{29 - n:02d}")  # not yet listed: may or may not show
            c.put(f"new{n}", {"x": b"x"})  # sealed meanwhile: may or may not show
        steady = [k for k in seen if k.startswith("k") and int(k[1:]) < 25]
        assert steady == [f"k{i:02d}" for i in range(25)]  # each once, in seal order
        assert len(seen) == len(set(seen))


def test_json_output_is_valid_whatever_a_meta_holds(daemon):
    """Another client's bytes or NaN in a meta: ls, show and evict --json stay valid JSON
    (evict's used to fail after it had evicted)."""
    s = daemon.socket_path
    with daemon.client() as c:
        c.put(
            "theirs",
            {"x": b"1"},
            meta={"tag": b"\x01", "v": float("nan"), "w": [float("inf"), 1.5]},
        )
        c.put("mine", {"x": b"1"})
    listed = json.loads(run("ls", "--json", "-s", s).stdout)
    meta = next(o["meta"] for o in listed if o["key"] == "theirs")
    assert meta == {"tag": "b'\\x01'", "v": "nan", "w": ["inf", 1.5]}
    assert json.loads(run("show", "theirs", "--json", "-s", s).stdout)[0]["meta"] == meta
    r = run("evict", "--all", "--yes", "--json", "-s", s)
    assert r.exit_code == 0 and json.loads(r.stdout)["count"] == 2
