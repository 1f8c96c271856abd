"""The import rules that keep the socket the folder boundary (docs/design.md).

- the contract (``kvbroker._wire``) imports nothing of kvbroker but ``kvbroker.errors``;
- the client side (``kvbroker._client``) and the server side (``kvbroker._server``) never
  import each other;
- the TUI imports only ``kvbroker`` (public) and the contract;
- the engine adapters (``kvbroker/integrations``) stand on kvbroker's public API only: no
  ``kvbroker._*`` module or ``_name`` imported from kvbroker, no ``obj._attr`` of anything
  but their own ``self`` (issue 37: ``client._mapping``, ``match._packed``... made
  ``_client``'s internals de facto API); besides its own package's, an adapter may import the
  adapters' shared modules (``kvbroker.integrations._link``), which obey the same rule;
- the public faces (``kvbroker``, ``blocks``, ``kv``, ``prefix``, ``gpu``, ``errors``,
  ``layout``) and the TUI never reach ``kvbroker._server``, counting what they import
  transitively, lazily or for annotations only: the client library is not the daemon; nor do
  the contract, the client side and the adapters;
- the CLI is also the daemon's front (``kvbroker serve``, ``doctor``): its commands import the
  daemon when they run, but importing the CLI reaches only the settings' declarations
  (``kvbroker._server.config*``, which make ``serve``'s options), so ``kvbroker --help`` and
  ``kvbroker stat`` do not load the daemon;
- there is no import cycle among kvbroker's modules;
- no module is over 600 lines and no class over 500 (issue 14), measured on the sources as
  ``ruff format`` writes them with the project's settings (the rule is about code, not
  typography): a larger one is split along a seam, one concept per private module;
- ``# fmt: skip`` only on the declarative tables (the op table, the settings' ``Key``
  declarations), where one row a line reads better than what the formatter would make.
"""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("cli", "tui"):
        parts.insert(0, "kvbroker")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, *, typing: bool = False, lazy: bool = True) -> set[str]:
    """Absolute names of the kvbroker modules (or packages) that ``path`` imports, lazy
    imports inside functions included (``lazy=False``: only those made when the module is
    imported), ``if TYPE_CHECKING:`` blocks left out (``typing=True``: counted)."""
    return set(_imports_of(path, path.read_text(), typing, lazy))


@functools.cache
def _imports_of(path: pathlib.Path, text: str, typing: bool, lazy: bool) -> frozenset[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(text, str(path))
    skipped = set()
    if not typing:  # annotations only: no import at run time
        skipped |= {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
    if not lazy:  # run when called, not when imported
        skipped |= {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(node)
        }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvbroker"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("kvbroker"):
                continue
            out.add(mod)
            # "from . import x" names a module when x is one
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if _path_of(sub) is not None:
                    out.add(sub)
    return frozenset(out)


def _path_of(module: str) -> pathlib.Path | None:
    parts = module.split(".")
    if parts[:2] in (["kvbroker", "cli"], ["kvbroker", "tui"]):
        parts = parts[1:]
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _sources(*folders: str) -> list[pathlib.Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("path", _sources("kvbroker/_wire"), ids=lambda p: p.name)
def test_contract_imports_only_errors(path):
    bad = {m for m in _imports(path) if not _within(m, "kvbroker._wire")} - {"kvbroker.errors"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _sources("kvbroker/_client"), ids=lambda p: p.name)
def test_client_never_imports_server(path):
    bad = {m for m in _imports(path) if _within(m, "kvbroker._server")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _sources("kvbroker/_server"), ids=lambda p: p.name)
def test_server_never_imports_client(path):
    bad = {m for m in _imports(path) if _within(m, "kvbroker._client")}
    bad |= {
        m
        for m in _imports(path)
        if m in ("kvbroker", "kvbroker.kv", "kvbroker.prefix", "kvbroker.gpu")
    }  # the client's faces
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _sources("tui"), ids=lambda p: p.name)
def test_tui_imports_only_public_kvbroker_and_the_contract(path):
    def allowed(m: str) -> bool:
        if _within(m, "kvbroker.tui") or _within(m, "kvbroker._wire"):
            return True
        # public modules: no underscore after "kvbroker."
        return not any(part.startswith("_") for part in m.split(".")[1:])

    bad = {m for m in _imports(path) if not allowed(m)}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def _private_uses(path: pathlib.Path) -> list[str]:
    """Where an adapter module reaches below kvbroker's public API: imports of a private
    kvbroker module (its own package's aside) or of a ``_name`` from kvbroker, lazy ones
    included, and ``x._attr`` (or ``getattr(x, "_attr")``) of anything but ``self``/``cls``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = ".".join(name.split(".")[:3])  # kvbroker.integrations.<engine>

    def allowed(m: str) -> bool:
        # its own package's modules, and the adapters' shared ones (kvbroker.integrations._x,
        # held to this same rule)
        return _within(m, own) or m.rpartition(".")[0] == "kvbroker.integrations"

    out = [
        f"imports {m}"
        for m in sorted(_imports(path))
        if not allowed(m) and any(part.startswith("_") for part in m.split(".")[1:])
    ]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = (
                package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            )
            mod = ".".join(base + ([node.module] if node.module else []))
            if (
                mod.startswith("kvbroker")
                and not _within(mod, own)
                and mod != "kvbroker.integrations"
            ):
                out += [
                    f"line {node.lineno}: imports {a.name} from {mod}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
        attr = None
        if isinstance(node, ast.Attribute):
            target, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target, attr = node.args[0], node.args[1].value
        if (
            attr
            and attr.startswith("_")
            and not (attr.startswith("__") and attr.endswith("__"))
            and not (isinstance(target, ast.Name) and target.id in ("self", "cls"))
        ):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("path", _sources("kvbroker/integrations"), ids=lambda p: p.name)
def test_integrations_use_only_the_public_api(path):
    bad = _private_uses(path)
    assert not bad, f"{path.relative_to(ROOT)} reaches below kvbroker's public API:\n" + "\n".join(
        bad
    )


def test_the_public_api_rule_sees_each_kind_of_reach():
    """The checker itself, on a probe module inside an adapter package."""
    probe = ROOT / "kvbroker" / "integrations" / "vllm" / "_probe_private.py"
    cases = {
        "from kvbroker._client.tp import shard_heads": "imports kvbroker._client.tp",
        "def f():\n    from ..._wire import names": "imports kvbroker._wire",
        "import kvbroker._client.engine": "imports kvbroker._client.engine",
        "from kvbroker.kv import _scatter": "imports _scatter from kvbroker.kv",
        "def f(client):\n    return client._mapping(0)": "client._mapping",
        "def f(m):\n    return getattr(m, '_packed')": "getattr(m, '_packed')",
        "from ..sglang import _pages": "imports _pages from kvbroker.integrations.sglang",
        "from kvbroker.integrations.sglang._pages import PageStore": "imports kvbroker.integrations.sglang._pages",
    }
    try:
        for source, found in cases.items():
            probe.write_text(source + "\n")
            assert any(found in line for line in _private_uses(probe)), source
        probe.write_text(
            "from kvbroker import blocks\nfrom . import _paged\n"
            "from .._link import BrokerLink\nfrom .. import _link\n"
            "class A:\n    def f(self):\n        return self._x, self.__dict__\n"
        )
        assert _private_uses(probe) == []
    finally:
        probe.unlink(missing_ok=True)


def _reached(module: str, **which: bool) -> dict[str, list[str]]:
    """Every kvbroker module that importing ``module`` can load, each with the chain of
    imports that reaches it (``which``: as for :func:`_imports`). A module also loads the
    packages above it."""
    chains = {module: [module]}
    todo = [module]
    while todo:
        at = todo.pop()
        path = _path_of(at)
        if path is None:
            continue
        found = _imports(path, **which)
        for m in list(found):  # importing kvbroker.a.b runs kvbroker/a/__init__.py first
            parts = m.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts)))
        for m in sorted(found):
            if m not in chains and _path_of(m) is not None:
                chains[m] = chains[at] + [m]
                todo.append(m)
    return chains


def _reaches_server(module: str, **which: bool) -> list[str]:
    return [
        " -> ".join(chain)
        for m, chain in sorted(_reached(module, **which).items())
        if _within(m, "kvbroker._server")
    ]


PUBLIC_FACES = [
    "kvbroker",
    "kvbroker.blocks",
    "kvbroker.kv",
    "kvbroker.prefix",
    "kvbroker.gpu",
    "kvbroker.errors",
    "kvbroker.layout",
]
NEVER_THE_SERVER = PUBLIC_FACES + sorted(
    _module_name(p)
    for p in _sources("tui", "kvbroker/_wire", "kvbroker/_client", "kvbroker/integrations")
)


@pytest.mark.parametrize("module", NEVER_THE_SERVER)
def test_faces_never_reach_the_server_even_transitively(module):
    bad = _reaches_server(module, typing=True, lazy=True)
    assert not bad, f"{module} reaches the daemon's code:\n" + "\n".join(bad)


# What importing the CLI may load of the daemon: the settings' declarations, from which
# `kvbroker serve`'s options are made.
CLI_SERVER_AT_IMPORT = {"kvbroker._server"}
CLI_SERVER_AT_IMPORT_PREFIX = "kvbroker._server.config"


@pytest.mark.parametrize("path", _sources("cli"), ids=lambda p: p.name)
def test_importing_the_cli_loads_only_the_settings_of_the_daemon(path):
    bad = [
        chain
        for chain in _reaches_server(_module_name(path), lazy=False)
        if chain.rpartition(" -> ")[2] not in CLI_SERVER_AT_IMPORT
        and not chain.rpartition(" -> ")[2].startswith(CLI_SERVER_AT_IMPORT_PREFIX)
    ]
    assert not bad, f"importing {path.name} loads the daemon:\n" + "\n".join(bad)


def test_the_transitive_rules_see_a_reach_through_another_module():
    """The checkers themselves, on probe modules: a face reaching the server through a
    public module's lazy import, a module of its own package, or an annotation; the CLI
    importing (not lazily) a daemon module through a helper."""
    probes = [
        ROOT / "kvbroker" / "_probe_face.py",
        ROOT / "kvbroker" / "_probe_via.py",
        ROOT / "cli" / "_probe_cli.py",
    ]
    face, via, cli = (_module_name(p) for p in probes)
    try:
        probes[0].write_text("from . import _probe_via\n")
        for source in (
            "def f():\n    from kvbroker._server import broker\n",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ._server.handlers import Handlers\n",
            "import kvbroker._server.daemon\n",
        ):
            probes[1].write_text(source)
            assert _reaches_server(face, typing=True, lazy=True), source
        probes[1].write_text("from . import errors\n")
        assert _reaches_server(face, typing=True, lazy=True) == []
        probes[2].write_text("from kvbroker import _probe_via\n")
        probes[1].write_text(
            "from ._server.config import SETTINGS\n"
            "def serve():\n    from ._server.daemon import run_daemon\n"
        )
        test_importing_the_cli_loads_only_the_settings_of_the_daemon(probes[2])  # passes
        probes[1].write_text("from ._server import daemon\n")
        with pytest.raises(AssertionError, match="_probe_via -> kvbroker._server.daemon"):
            test_importing_the_cli_loads_only_the_settings_of_the_daemon(probes[2])
    finally:
        for p in probes:
            p.unlink(missing_ok=True)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for path in _sources("kvbroker", "cli", "tui"):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path) if _path_of(m) is not None and m != name}
    # a package's __init__ re-exporting its modules is not a cycle of the modules themselves
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if _within(node, nxt):  # a module importing its own package's face
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 500


def _oversized(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """What in ``path`` is over the size limits: the module, or a class (decorators aside)."""
    text = path.read_text()
    where = path.relative_to(root)
    out = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        out.append(f"{where}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_CLASS_LINES:
                out.append(f"{where}: class {node.name} is {n} lines (at most {MAX_CLASS_LINES})")
    return out


def _formatted_copy(dest: pathlib.Path) -> pathlib.Path:
    """The product's sources (kvbroker/, cli/, tui/) copied under ``dest`` and formatted there
    by ``ruff format`` with the project's settings (its pyproject.toml beside them)."""
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for path in _sources("kvbroker", "cli", "tui"):
        copy = dest / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy)
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--quiet", str(dest)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"ruff format (make install-test installs it): {done.stderr}"
    return dest


def test_no_module_or_class_over_the_size_limits(tmp_path):
    formatted = _formatted_copy(tmp_path)
    big = [line for path in sorted(formatted.rglob("*.py")) for line in _oversized(path, formatted)]
    assert not big, "split along a seam:\n" + "\n".join(big)


def test_the_size_check_measures_formatted_code(tmp_path):
    """A module under the limit as typed, one long line a call argument, is over it once
    formatted: the check counts what ruff format makes of it."""
    probe = ROOT / "kvbroker" / "_probe_dense.py"
    args = ", ".join(f"a{i}" for i in range(40))
    probe.write_text("def f():\n" + f"    return g({args})\n" * (MAX_MODULE_LINES - 2))
    try:
        assert len(probe.read_text().splitlines()) < MAX_MODULE_LINES
        formatted = _formatted_copy(tmp_path)
        assert _oversized(formatted / "kvbroker" / "_probe_dense.py", formatted)
    finally:
        probe.unlink(missing_ok=True)


# The declarative tables (file, name) whose last line may tell the formatter to skip them.
FMT_SKIP_TABLES = {
    ("kvbroker/_wire/protocol.py", "OPS"),
    ("kvbroker/_server/config.py", "SETTINGS"),
}


_FMT = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")


def _fmt_skips(path: pathlib.Path) -> list[str]:
    """The ``# fmt: skip`` / ``off`` / ``on`` comments of ``path`` that do not end one of the
    declarative tables above."""
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    tables = {
        n.end_lineno
        for n in ast.parse(text, str(path)).body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and (rel, t.id) in FMT_SKIP_TABLES
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
    }
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and _FMT.search(tok.string):
            if not (tok.string.strip() == "# fmt: skip" and tok.start[0] in tables):
                out.append(f"{rel}:{tok.start[0]}: {tok.string}")
    return out


def _repository_sources() -> list[pathlib.Path]:
    return sorted(
        set(_sources("kvbroker", "cli", "tui", "tests", "benchmarks", "examples"))
        | set(ROOT.glob("*.py"))
    )


def test_fmt_skip_only_on_declarative_tables():
    bad = [line for path in _repository_sources() for line in _fmt_skips(path)]
    assert not bad, "let ruff format it (or add the table to FMT_SKIP_TABLES):\n" + "\n".join(bad)


def test_the_fmt_skip_check_sees_a_marker_off_a_table():
    probe = ROOT / "kvbroker" / "_wire" / "_probe_skip.py"
    try:
        probe.write_text("X = {\n    'a': 1,\n}  # fmt: skip\n")
        assert _fmt_skips(probe) == ["kvbroker/_wire/_probe_skip.py:3: # fmt: skip"]
        probe.write_text("# fmt: off\nY = [1,\n 2]\n# fmt: on\n")
        assert len(_fmt_skips(probe)) == 2
    finally:
        probe.unlink(missing_ok=True)


def test_the_size_check_sees_an_oversized_module(tmp_path):
    """The checker itself: a module one line too long, holding a class one line too long."""
    long = tmp_path / "long.py"
    long.write_text(
        "class Big:\n"
        + "    x = 1\n" * MAX_CLASS_LINES
        + "\n" * (MAX_MODULE_LINES - MAX_CLASS_LINES)
    )
    assert len(_oversized(long, tmp_path)) == 2
    long.write_text("class Small:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1))
    assert _oversized(long, tmp_path) == []


def test_the_rules_see_a_violation(tmp_path, monkeypatch):
    """The checker itself: a module that imports across the boundary is reported."""
    bad = ROOT / "kvbroker" / "_wire" / "_probe_violation.py"
    bad.write_text("from .._server import broker\n")
    try:
        assert "kvbroker._server" in _imports(bad) or "kvbroker._server.broker" in _imports(bad)
    finally:
        bad.unlink()


# -- the daemon as owners (issue 40) ----------------------------------------------------------
SERVER = ROOT / "kvbroker" / "_server"
# The coordinators: a module-level function that takes one reads and changes their parts
# from outside (the owners' transitions are methods, each owner's state its own).
_COORDINATORS = ("Broker", "Transitions", "Daemon")
_COORDINATOR_PARAMS = ("b", "broker", "d", "daemon")


def _takes_a_coordinator(path: pathlib.Path) -> list[str]:
    """The module-level functions of ``path`` with a parameter annotated as the Broker (or
    its Transitions) or the Daemon, or named as one conventionally is (``b``, ``d``...)."""
    out = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            named = set()
            for n in ast.walk(ast.parse(note or "None")):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):  # "Daemon"
                    n = ast.parse(n.value)
                named |= {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
            if named & set(_COORDINATORS) or arg.arg in _COORDINATOR_PARAMS:
                out.append(f"{path.name}: {node.name}({arg.arg}: {note or '?'})")
                break
    return out


def test_no_module_function_takes_the_broker_or_the_daemon():
    """Each owner makes its own transitions: handlers, eviction, prefix leases, statistics,
    restore, start-up and a setting's reload are methods of an owner or take owners, never
    the coordinators. No exemption: a setting's ``Key`` names owners' attributes and methods
    (config_apply), which the daemon resolves itself."""
    bad = [line for path in sorted(SERVER.glob("*.py")) for line in _takes_a_coordinator(path)]
    assert not bad, "module-level functions taking the Broker or the Daemon:\n" + "\n".join(bad)


def test_the_coordinator_rule_sees_each_kind_of_argument(tmp_path):
    probe = tmp_path / "probe.py"
    for source in (
        "def f(b: Broker): pass",
        "def f(x: 'Daemon | None'): pass",
        "def f(s, *, daemon): pass",
        "def f(x: Transitions) -> int: return 1",
    ):
        probe.write_text(source + "\n")
        assert _takes_a_coordinator(probe), source
    probe.write_text(
        "class A:\n    def f(self, b: Broker): pass\ndef g(leases: LeaseTable): pass\n"
    )
    assert _takes_a_coordinator(probe) == []


def test_no_import_cycle_in_the_server_counting_type_checking_imports():
    """``kvbroker._server`` drawn as modules and imports (``python -m
    kvbroker._server.structure``) has no circle, annotations' imports included."""
    from kvbroker._server.structure import cycles, import_graph

    graph = import_graph(SERVER)
    assert "broker" in graph and "handlers" in graph["broker"]  # the graph sees imports
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_structure_graph_counts_type_checking_and_lazy_imports(tmp_path):
    from kvbroker._server.structure import cycles, import_graph

    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "c.py").write_text("from .a import Y\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b", "a"]]


def test_the_design_doc_draws_the_server_as_it_is():
    """docs/design.md's drawing of kvbroker/_server is the structure module's output."""
    from kvbroker._server.structure import import_graph, mermaid

    doc = (ROOT / "docs" / "design.md").read_text()
    drawn = "```mermaid\n" + mermaid(import_graph(SERVER)) + "\n```"
    assert drawn in doc, (
        "docs/design.md's drawing of kvbroker/_server is out of date: "
        "paste `python -m kvbroker._server.structure` in"
    )
