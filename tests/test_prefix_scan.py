"""The C twins of a prefix match's per-block passes (kvbroker._prefixscan, csrc/prefixscan.c)
give what their Python twins in kvbroker._server.prefix_leases give, on any blocks: chains
or not, interleaved or broken anywhere, shapes known or not, equal or not, and any keys."""

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker._server import prefix_leases as PL
from kvbroker._server.state import StoredObject

try:
    from kvbroker import _prefixscan as scan
except ImportError as exc:
    scan, import_error = None, exc


def needs_c():
    """The C module; a skip only where it was not built (its file is absent), a failure where
    it was built and does not import."""
    if scan is None:
        if importlib.util.find_spec("kvbroker._prefixscan") is not None:
            pytest.fail(f"kvbroker._prefixscan was built but does not import: {import_error}")
        pytest.skip("C pass not built here")
    return scan


class _Pool:
    index = 3


NAMES = [("k", "v"), ("k", "v", "x"), ("a",)]


def _block(i: int, names: tuple[str, ...], size: int) -> StoredObject:
    buffers = {name: (i * 4096 + j * size, size) for j, name in enumerate(names)}
    return StoredObject("ns", f"b{i}", _Pool(), i, 1, size * len(names), buffers, None, i)


@st.composite
def blocks(draw):
    """Blocks laid out as ``stride`` interleaved chains, then perturbed: some parents moved
    (to another block, to none), some shapes left unknown, some of other names or sizes."""
    n = draw(st.integers(0, 24))
    stride = draw(st.integers(1, 4))
    names = NAMES[draw(st.integers(0, len(NAMES) - 1))]
    size = draw(st.sampled_from([16, 64]))
    found = []
    for i in range(n):
        odd = draw(st.integers(0, 19)) == 0  # another layout, now and then
        found.append(
            _block(
                i,
                NAMES[(NAMES.index(names) + 1) % len(NAMES)] if odd else names,
                size * 2 if odd and draw(st.booleans()) else size,
            )
        )
    for i, obj in enumerate(found):
        obj.parent = found[i - stride] if i >= stride else None
        if draw(st.integers(0, 9)) == 0 and n:  # a broken link
            obj.parent = draw(st.sampled_from([None, *found]))
        if draw(st.integers(0, 9)) != 0:  # matched before: its shape and row known
            obj.compact_extents()
    return found


@settings(max_examples=400, deadline=None)
@given(blocks(), st.floats(0, 2e9, allow_nan=False))
def test_lend_scan_agrees_with_its_python_twin(found, now):
    got = needs_c().lend_scan(found, now)
    assert all(o.last_access == now for o in found)
    for o in found:
        o.last_access = -1.0
    assert got == PL._lend_scan_py(found, now)  # the scans change nothing but last_access
    assert all(o.last_access == now for o in found)


def test_lend_scan_on_known_blocks():
    c = needs_c()
    found = [_block(i, ("k",), 16) for i in range(6)]
    for i, obj in enumerate(found):
        obj.parent = found[i - 2] if i >= 2 else None
        obj.compact_extents()
    assert c.lend_scan(found, 1.0) == (2, b"".join(o.row for o in found))
    assert len(c.lend_scan(found, 1.0)[1]) == 6 * 3 * 8  # a row: pool, then offset, size
    found[4].parent = found[1]  # a broken link in the middle: no chains
    assert c.lend_scan(found, 1.0)[0] == 0
    found[5].shape, found[5].row = None, None  # not matched since its seal: no joined rows
    assert c.lend_scan(found, 1.0)[1] is None
    assert c.lend_scan(found[:1], 1.0) == (0, found[0].row)  # one block: no chain
    assert c.lend_scan([], 1.0) == (0, None)


keys = st.one_of(
    st.sampled_from([f"b{i}" for i in range(8)]),
    st.text(max_size=3),
    st.integers(),
    st.binary(max_size=3),
    st.lists(st.integers(), max_size=1),
    st.none(),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(keys, max_size=12), st.sets(st.integers(0, 7)))
def test_run_agrees_with_its_python_twin(asked, present):
    space = {f"b{i}": object() for i in present}
    assert needs_c().run(space, asked) == PL._run_py(space, asked)


def test_run_stops_at_the_first_miss_or_non_string():
    scan = needs_c()
    a, b = object(), object()
    space = {"a": a, "b": b}
    assert scan.run(space, ["a", "b", "a"]) == [a, b, a]
    assert scan.run(space, ["a", "zz", "b"]) == [a]
    assert scan.run(space, ["a", 1, "b"]) == [a]
    assert scan.run(space, ["a", ["b"], "b"]) == [a]  # unhashable: the run ends before it
    assert scan.run(space, []) == []


def test_bad_arguments_are_type_errors():
    scan = needs_c()
    with pytest.raises(TypeError):
        scan.run({}, ("a",))
    with pytest.raises(TypeError):
        scan.lend_scan((), 1.0)
    with pytest.raises(TypeError):
        scan.lend_scan([], 1)
    with pytest.raises(AttributeError):  # not blocks: nothing half-done is hidden
        scan.lend_scan([object(), object()], 1.0)


def test_the_daemon_uses_the_c_pass_where_it_is_built():
    scan = needs_c()
    assert PL._run is scan.run and PL._lend_scan is scan.lend_scan


def test_the_c_pass_is_built_where_a_compiler_is():
    """Optional so that an install without a compiler still works; where one is (CI, the
    project's machines), a failed build must not hide behind the Python twins."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") and headers):
        pytest.skip("no C compiler or no Python headers: the Python twins are expected")
    if scan is None:
        pytest.fail("kvbroker._prefixscan was not built here; reinstall (pip install -e .)")


def _run_alone(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a crash there is a failed assertion here."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_lend_scan_outlives_a_getter_that_empties_the_list():
    """The scan loops over a tuple taken at entry: a block's ``parent`` getter that empties
    the list (dropping the only references to the other blocks) changes nothing (a loop
    over the list itself read freed memory: the interpreter crashed)."""
    needs_c()
    done = _run_alone("""
        from kvbroker import _prefixscan as scan

        found = []

        class Block:
            shape = row = None

            @property
            def parent(self):
                found.clear()
                return None

        found.extend(Block() for _ in range(64))
        blocks = list(found)
        print(scan.lend_scan(found, 5.0), len(found), all(b.last_access == 5.0 for b in blocks))
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["(0,", "None)", "0", "True"]


def test_run_outlives_a_key_comparison_that_empties_the_list():
    """``run`` loops over a tuple too: a key of ``space`` whose ``__eq__`` empties the list
    of keys looked up (the lookup of an equal hash calls it) changes nothing."""
    needs_c()
    done = _run_alone("""
        from kvbroker import _prefixscan as scan

        keys = ["k%d" % i for i in range(64)]
        armed = []

        class Collides:
            def __hash__(self):
                return hash(keys[0])

            def __eq__(self, other):
                if armed:
                    keys.clear()
                return False

        space = {Collides(): None, **{k: k.upper() for k in keys}}
        armed.append(1)
        print(*scan.run(space, keys), len(keys))
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"K{i}" for i in range(64)] + ["0"]
