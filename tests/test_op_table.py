"""The op table (``kvbroker._wire.protocol.OPS``) and what is derived from it.

Each op is one row: arguments, reply type, service, lease role, what a draining daemon does.
These tests catch the mistakes a derivation would otherwise carry silently: a row without a
handler (or a handler without a row), a lease-naming op not marked so (a reconnect would
resend it), a lease-taking op a draining daemon would still serve, an error code without its
class, and a reply that is not the type its row declares.
"""

from __future__ import annotations

import inspect
import struct
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbroker.errors as errors
from kvbroker._server.connection import Connection
from kvbroker._server.handlers import HANDLERS
from kvbroker._server.rings import RingService
from kvbroker._wire.protocol import (
    ERROR_CODES,
    LEASE_NAMING_OPS,
    OPS,
    REFUSED_WHILE_DRAINING,
    LeaseRole,
    Service,
    check_reply,
    validate_args,
)

_SERVICE_HANDLERS = {
    Service.BROKER: lambda name: HANDLERS.get(name),
    Service.RINGS: lambda name: getattr(RingService, "op_" + name, None),
    Service.DAEMON: lambda name: getattr(Connection, "op_" + name, None),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_row_has_its_handler_taking_its_arguments(name):
    op = OPS[name]
    handler = _SERVICE_HANDLERS[op.service](name)
    assert handler is not None, f"{name}: no handler in the {op.service.value} service"
    params = list(inspect.signature(handler).parameters)
    skip = 2  # (broker, session) or (self, session)
    assert params[skip:] == list(op.args), f"{name}: handler arguments {params[skip:]}"


def test_no_handler_without_a_row():
    assert set(HANDLERS) == {n for n, op in OPS.items() if op.service is Service.BROKER}
    for cls, service in ((RingService, Service.RINGS), (Connection, Service.DAEMON)):
        names = {m[3:] for m in dir(cls) if m.startswith("op_")}
        assert names == {n for n, op in OPS.items() if op.service is service}, cls


def test_error_codes_map_to_classes_and_back():
    assert ERROR_CODES == tuple(cls.code for cls in errors.ERROR_CLASSES)
    assert len(set(ERROR_CODES)) == len(ERROR_CODES)
    for code in ERROR_CODES:
        exc = errors.error_for_code(code, "m")
        assert exc.code == code and type(exc) is not errors.KVBrokerError, code
    public = {getattr(errors, n) for n in errors.__all__}
    classes = {c for c in public if inspect.isclass(c) and c is not errors.KVBrokerError}
    assert classes == set(errors.ERROR_CLASSES)  # a new error class gets a wire code


def test_lease_roles_match_the_arguments():
    for name, op in OPS.items():
        names_a_lease = any(a in op.args for a in ("lease", "leases", "arena"))
        assert (LeaseRole.NAMES in op.lease) == names_a_lease, name
    from kvbroker._client.client import _LEASE_OPS

    assert _LEASE_OPS == LEASE_NAMING_OPS


def test_a_draining_daemon_hands_out_no_lease():
    for name, op in OPS.items():
        if LeaseRole.TAKES in op.lease:
            assert op.draining.refuse or op.draining.args, name
        for arg, _ in op.draining.args:
            assert arg in op.args, (name, arg)
    assert REFUSED_WHILE_DRAINING == {n for n, op in OPS.items() if op.draining.refuse}
    assert not OPS["hello"].needs_hello and all(
        op.needs_hello for n, op in OPS.items() if n != "hello"
    )


@pytest.fixture
def ring_daemon(make_daemon):
    return make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--gpu-ring",
        "1M",
        env={"KVBROKER_FAKE_GPUS": "1"},
    )


def test_every_reply_is_its_declared_type(ring_daemon):
    """Each op answered successfully, in each reply shape it has, against its row."""
    seen: set[str] = set()
    with ring_daemon.client(map_pools=False) as c:

        def call(op, **args):
            result = c._call(op, **args)
            reason = check_reply(op, result)
            assert reason is None, (reason, result)
            seen.add(op)
            return result

        call("hello", version=1, name="table")
        lease = call("reserve", key="a", buffers={"kv": 100}, meta={"m": 1})["lease"]
        call("seal", lease=lease, checksums=None)
        abort = call("reserve", key="gone", buffers={"kv": 10})["lease"]
        call("abort", lease=abort)
        arena = call("arena", nbytes=64 * 1024)["lease"]
        call("publish", arena=arena, key="b", buffers={"kv": 100}, next_arena=64 * 1024)
        call("publish", arena=arena, key="b2", buffers={"kv": 100}, next_arena=0)
        read = call("claim", key="a", select="kv")["lease"]
        call("renew", leases=[read], ttl=5)
        call("release", lease=read)
        assert call("lookup", key="a")["checksums"] is None and call("lookup", key="x") is None
        assert call("exists", key="a") is True and call("exists", key="x") is False
        call("list", match="a")
        page = call("list", limit=1)
        assert page["truncated"] and page["next"] is not None
        assert call("list", after=page["next"])["next"] is None
        described = call("lookup", key="b")
        assert described["buffer_sizes"] == {"kv": 100} and described["consumers"] == 1
        blocks = call(
            "reserve_blocks",
            namespace="p",
            blocks=[
                {"key": "p0", "parent": None, "buffers": {"kv": 64}},
                {"key": "p1", "parent": "p0", "buffers": {"kv": 64}, "meta": {"n": 1}},
            ],
        )["results"]
        call("seal_many", leases=[r["lease"] for r in blocks])
        assert call("reserve_blocks", namespace="p", blocks=[{"key": "p0", "buffers": {"kv": 64}}])[
            "results"
        ] == [{"exists": True}]
        # Buffers and meta once for the batch, compact reply: a packed row per reserved block.
        compact = call(
            "reserve_blocks",
            namespace="p",
            blocks=[
                {"key": "p0"},
                {"key": "q1", "parent": "p0"},
                {"key": "q2", "meta": {"own": 1}},
            ],
            buffers={"k": 32, "v": 32},
            meta={"n": 2},
            compact=True,
        )
        assert compact["results"] == [] and compact["names"] == ["k", "v"]
        assert compact["leases"][0] is None and all(compact["leases"][1:])
        rows = struct.unpack(f"<{len(compact['packed']) // 8}q", compact["packed"])
        assert len(rows) == 2 * 5 and rows[2] == rows[4] == 32  # [pool, off, 32, off, 32] x2
        call("seal_many", leases=compact["leases"][1:])
        assert call("lookup", namespace="p", key="q1")["meta"] == {"n": 2}
        assert call("lookup", namespace="p", key="q2")["meta"] == {"own": 1}
        with pytest.raises(errors.BadRequest, match="given per block or once"):
            call("reserve_blocks", namespace="p", blocks=[{"key": "q3"}])
        packed = call("match_prefix", namespace="p", keys=["p0", "p1"], block_tokens=16)
        assert packed["packed"] and packed["matched"] == 2
        call("release_many", leases=[packed["lease"]])
        assert call("match_prefix", namespace="p", keys=["nope"])["lease"] is None
        mixed = call("reserve", namespace="p", key="p2", buffers={"other": 8})["lease"]
        call("seal", lease=mixed)
        varied = call("match_prefix", namespace="p", keys=["p1", "p2"])
        assert "packed" not in varied and len(varied["blocks"]) == 2
        call("release_many", leases=[varied["lease"]])
        kept = call(
            "match_prefix",
            namespace="p",
            keys=["p0"],
            hold=False,
            retain={"session": "conv", "for": 60, "priority": 1},
        )
        assert kept["matched"] == 1
        listed = call("sessions", namespace="p")
        assert [x["name"] for x in listed["sessions"]] == ["conv"]
        assert call("retain", name="conv", seconds=30)["blocks"] == 1
        assert call("unretain", name="conv", namespace="p")["name"] == "conv"
        call("evict", namespace="default", match="^b", dry_run=True)
        call("evict", namespace="p")
        call("rings")
        ring = call("ring_reserve", device=0, nbytes=1000, key="r", meta={"x": 1})
        call("ring_seal", lease=ring["lease"])
        assert call("ring_lookup", keys=["r", "none"])["objects"] == [
            {"device": 0, "nbytes": 1000, "meta": {"x": 1}},
            None,
        ]
        got = call("ring_claim", key="r")
        call("ring_release", lease=got["lease"])
        scratch = call("ring_reserve", device=0, nbytes=10)
        call("ring_release", lease=scratch["lease"])
        # an object already here is never pulled: no peer is contacted
        assert call("fetch", key="a", peer="127.0.0.1:9")["fetched"] is False
        assert call("report", counters={"loaded_tokens": 32, "saved_tokens": 0}) == {"counters": 2}
        reported = [c for c in call("stat")["clients"] if c["reported"]]
        assert reported[0]["reported"] == {"loaded_tokens": 32, "saved_tokens": 0}
        for bad in ({"x": -1}, {"x": True}, {"": 1}, {f"c{i}": 1 for i in range(33)}):
            with pytest.raises(errors.BadRequest):
                call("report", counters=bad)
        call("ping")
        call("watch", interval=0)
    assert seen == set(OPS)


def test_the_design_doc_shows_the_current_op_table():
    """docs/design.md's op table is generated from OPS; a row added or changed in the table
    must show there too (regenerate between the markers with markdown_table())."""
    import pathlib
    import re

    from kvbroker._wire.protocol_doc import markdown_table

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    m = re.search(r"<!-- op-table[^\n]*-->\n(.*?)<!-- /op-table -->", doc, re.S)
    assert m, "docs/design.md has lost its op-table markers"
    assert m.group(1) == markdown_table()


_LIMITS = SimpleNamespace(max_lease_ttl=3600.0)  # the serving side's, for the TTL rule


class _Args(dict):
    """A dict of another class: validate_args checks it the long way, argument by argument."""


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


_OF_CLASS = {
    type(None): st.none(),
    bool: st.booleans(),
    int: st.integers(-(2**70), 2**70),
    float: st.floats(allow_nan=False),
    str: st.text(max_size=8),
    bytes: st.binary(max_size=8),
    list: st.lists(st.integers(), max_size=3),
    dict: st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
}


@st.composite
def _requests(draw):
    """An op and arguments as a client (or a hostile one) might send them: mostly each of the
    op's arguments, of any class, sometimes one missing or one unknown."""
    name = draw(st.sampled_from(sorted(OPS)))
    args = {}
    for a, arg in OPS[name].args.items():
        if draw(st.integers(0, 19)):  # mostly there, mostly of a class the row accepts
            fitting = [_OF_CLASS[t] for t in arg.types if t in _OF_CLASS]
            args[a] = draw(st.one_of(*fitting) if fitting and draw(st.integers(0, 5)) else _VALUES)
    if draw(st.booleans()):
        args[draw(st.text(min_size=1, max_size=6))] = draw(_VALUES)
    return name, args


@settings(max_examples=2000, deadline=None)
@given(_requests())
def test_validate_args_answers_as_the_table_says_whichever_way_it_checks(request):
    """The fast path (every argument, of exactly an accepted class) agrees with the long
    check: the same arguments back, or the same refusal."""
    name, args = request

    def outcome(raw):
        try:
            return "ok", dict(validate_args(name, raw, _LIMITS))
        except errors.BadRequest as exc:
            return "refused", str(exc)

    assert outcome(dict(args)) == outcome(_Args(args))


def test_validate_args_takes_the_fast_path_for_what_clients_send():
    raw = {
        "namespace": "default",
        "key": "k",
        "select": None,
        "consume": True,
        "wait": None,
        "ttl": None,
        "peer": None,
    }
    assert validate_args("claim", raw, _LIMITS) is raw
    # a bool where a count is meant is refused, whichever way
    with pytest.raises(errors.BadRequest, match="lease must be int"):
        validate_args("release", {"lease": True, "consume": True}, _LIMITS)
