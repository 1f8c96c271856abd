"""The client's typed op stubs (kvbroker._client.ops) against the op table: one stub per op,
taking exactly the op's arguments with the table's defaults, and no other client code naming
an op."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from kvbroker._client.ops import LEASE_OPS, Ops
from kvbroker._wire.protocol import OPS

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LATER = {"abort_later": "abort", "release_later": "release"}  # pipelined variants


def _stubs() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(Ops).items()
        if callable(fn) and not name.startswith("_")
    }


def test_one_stub_per_op():
    assert set(_stubs()) - set(_LATER) == set(OPS)
    assert set(_LATER.values()) <= set(OPS)
    assert LEASE_OPS <= set(OPS)


@pytest.mark.parametrize("op", sorted(OPS))
def test_stub_takes_the_ops_arguments_with_its_defaults(op):
    params = dict(list(_stubs()[op].parameters.items())[1:])  # without self
    assert set(params) == set(OPS[op].args)
    for name, arg in OPS[op].args.items():
        p = params[name]
        if arg.required:
            assert p.default is inspect.Parameter.empty, f"{op}: {name} is required"
        else:
            assert p.default == arg.default, f"{op}: {name} defaults to {arg.default!r}"


@pytest.mark.parametrize("stub", sorted(_stubs()))
def test_stub_sends_what_it_takes(stub):
    sent = []
    ops = Ops(lambda op, a: sent.append((op, a)), lambda op, a: sent.append((op, a)))
    params = list(_stubs()[stub].parameters.values())[1:]
    args = {
        p.name: f"<{p.name}>" if p.default is inspect.Parameter.empty else p.default for p in params
    }
    if "buffers" in args:
        args["buffers"] = {}
    getattr(ops, stub)(**args)
    ((op, got),) = sent
    assert op == _LATER.get(stub, stub)
    want = dict(args)
    if stub == "release_later":
        want["consume"] = True
    if stub in ("match_prefix", "reserve_blocks", "reserve", "publish"):  # retain if given
        assert want.pop("retain") is None
    if stub in ("list", "evict"):  # tier only when not all: a daemon from before it lacks it
        assert want.pop("tier") == "all"
        sent.clear()
        getattr(ops, stub)(**{**args, "tier": "dram"})
        assert sent[0][1] == {**want, "tier": "dram"}
    if stub == "match_prefix":  # hold only when false: a daemon from before it lacks it
        assert want.pop("hold") is True
        sent.clear()
        ops.match_prefix(**{**args, "hold": False})
        assert sent[0][1] == {**want, "hold": False}
    assert got == want


def _names_an_op(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if (
        name
        in (
            "_call",
            "_send_only",
            "call",
            "send_only",
            "_request",
            "request",
            "_post",
            "post",
            "_submit",
            "submit",
        )
        and node.args
    ):
        first = node.args[0]
        if isinstance(first, ast.Constant) and first.value in OPS:
            return first.value
    return None


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for folder in ("kvbroker", "cli", "tui")
        for p in (ROOT / folder).rglob("*.py")
        if "_server" not in p.parts and p.name != "ops.py"
    ),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_only_the_stubs_name_an_op(path):
    tree = ast.parse(path.read_text(), str(path))
    named = [
        (n.lineno, op)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (op := _names_an_op(n))
    ]
    assert not named, f"{path.name} calls ops by name: {named}"


def test_pipelined_stubs_answer_in_order_and_raise_at_result(client):
    """``ops.pipelined``: several requests in the daemon's queue at once; each Pending gives
    its own reply, a failed one raises at ``result()`` and leaves the others intact, and a
    plain call in between reads past the replies it is not waiting for."""
    from kvbroker.errors import Exists

    p = client.ops.pipelined
    first = p.reserve("pipe-a", {"x": 8})
    second = p.reserve("pipe-b", {"x": 8})
    clash = p.reserve("pipe-a", {"x": 8})  # a second writer of the same key
    assert client.ops.lookup("pipe-z") is None  # a plain call while three are queued
    a, b = first.result(), second.result()
    assert a["lease"] != b["lease"]
    with pytest.raises(Exists):
        clash.result()
    seals = [p.seal(a["lease"]), p.seal(b["lease"])]
    assert [s.result()["key"] for s in seals] == ["pipe-a", "pipe-b"]
    assert {o.key for o in client.list(match="pipe-")} == {"pipe-a", "pipe-b"}


def test_replies_of_pipelined_requests_never_taken_are_read_at_close(daemon):
    with daemon.client() as c:
        lease = c.ops.reserve("pipe-close", {"x": 8})["lease"]
        c.ops.pipelined.seal(lease)  # its result is never asked for
    with daemon.client() as c:
        assert c.lookup("pipe-close") is not None  # the seal took effect before close ended
