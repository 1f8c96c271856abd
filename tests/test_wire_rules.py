"""Argument rules and the ``replica`` column, declared once in the op table
(``kvbroker._wire.rules``, ``kvbroker._wire.protocol.OPS``) and applied on every path: the
daemon, its GPU rings, its read replicas, the peer channel."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kvbroker._client.replica import answers
from kvbroker._wire.peer import PEER_OPS, validate_peer_args
from kvbroker._wire.protocol import OPS, REPLICA_OPS, REPLICA_ROUTED_OPS, validate_args
from kvbroker._wire.rules import LEASE_TTL
from kvbroker.errors import BadRequest

_LIMITS = SimpleNamespace(max_lease_ttl=60.0)
_BAD_TTLS = (math.nan, math.inf, -math.inf, -1.0, 0, 0.0, 61, 1e300)


def _with_ttl(declared):
    def args(row):
        return row if isinstance(row, dict) else row.args

    return sorted(name for name, row in declared.items() if "ttl" in args(row))


def test_every_ttl_argument_declares_the_ttl_rule():
    assert _with_ttl(OPS) == [
        "claim",
        "match_prefix",
        "renew",
        "reserve",
        "reserve_blocks",
        "ring_reserve",
    ]
    assert all(OPS[op].args["ttl"].rule is LEASE_TTL for op in _with_ttl(OPS))
    assert _with_ttl(PEER_OPS) == ["pin", "pin_prefix", "renew"]
    assert all(PEER_OPS[op]["ttl"].rule is LEASE_TTL for op in _with_ttl(PEER_OPS))


def _minimal(op: str) -> dict:
    """The op's arguments, each required one given a value of its first type."""
    sample = {int: 1, str: "k", list: [], dict: {}, float: 1.0, bool: False}
    return {name: sample[arg.types[0]] for name, arg in OPS[op].args.items() if arg.required}


@pytest.mark.parametrize("op", _with_ttl(OPS))
@pytest.mark.parametrize("ttl", _BAD_TTLS, ids=repr)
def test_validate_args_refuses_a_ttl_out_of_range_on_both_paths(op, ttl):
    long = _minimal(op) | {"ttl": ttl}
    full = {name: arg.default for name, arg in OPS[op].args.items()} | long  # the fast path
    for raw in (long, full):
        with pytest.raises(BadRequest, match=rf"^{op}: ttl must be in \(0, 60\] seconds"):
            validate_args(op, raw, _LIMITS)
    for ok in (None, 0.5, 60):
        assert validate_args(op, _minimal(op) | {"ttl": ok}, _LIMITS)["ttl"] == ok


@pytest.mark.parametrize("op", _with_ttl(PEER_OPS))
def test_the_peer_channel_applies_the_same_rule(op):
    raw = {"key": "k", "keys": [], "lease": 1}
    raw = {k: v for k, v in raw.items() if k in PEER_OPS[op]}
    for ttl in _BAD_TTLS:
        with pytest.raises(BadRequest, match=r"ttl must be in \(0, 60\] seconds"):
            validate_peer_args(op, raw | {"ttl": ttl}, _LIMITS)
    assert validate_peer_args(op, raw | {"ttl": 5}, _LIMITS)["ttl"] == 5


def test_the_replica_column_says_what_replicas_answer_and_clients_send_them():
    assert REPLICA_OPS == {"hello", "exists", "match_prefix", "ping"}
    assert REPLICA_ROUTED_OPS == {"exists", "match_prefix"}
    from kvbroker._server import replica

    assert replica.REPLICA_OPS is REPLICA_OPS  # the replica's own list is the table's
    assert answers("exists", {"namespace": "n", "key": "k"})
    assert answers("match_prefix", {"keys": [], "hold": False, "peer": None})
    assert not answers("match_prefix", {"keys": []})  # hold defaults to true: a lease
    assert not answers("match_prefix", {"keys": [], "hold": False, "peer": "h:1"})
    assert not answers("hello", {"version": 1}) and not answers("ping", {})
    assert not any(answers(op, {}) for op in set(OPS) - REPLICA_OPS)


@pytest.mark.parametrize("op", sorted(REPLICA_OPS))
def test_the_replica_answers_each_of_its_ops_with_the_rows_arguments(op):
    """A replica's handler takes exactly its row's arguments: one the table gained (e.g.
    match_prefix's retain) made every request of that op a replica failure, answered by the
    daemon instead."""
    import inspect

    from kvbroker._server.replica import _ReplicaConnection

    params = list(inspect.signature(getattr(_ReplicaConnection, "op_" + op)).parameters)
    assert params[1:] == list(OPS[op].args)


@pytest.fixture
def rings_and_replica(make_daemon):
    d = make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--gpu-ring",
        "1M",
        "--read-replicas",
        "1",
        env={"KVBROKER_FAKE_GPUS": "1"},
    )
    d.wait_ready()
    return d


def test_a_bad_ttl_gets_the_same_refusal_on_every_path(rings_and_replica):
    """The daemon's handlers, its GPU rings and its read replica refuse a NaN, an infinite,
    a negative or a too long TTL with the one rule's words (they once had a check each)."""
    refusals: dict[str, set[str]] = {}
    with rings_and_replica.client(map_pools=False) as c:
        c.ops.seal(c.ops.reserve("k0", {"x": 8})["lease"])  # there: a claim gets to its TTL
        paths = {
            "reserve": lambda t: c.ops.reserve("k1", {"x": 8}, ttl=t),
            "reserve_blocks": lambda t: c.ops.reserve_blocks([], ttl=t),
            "claim": lambda t: c.ops.claim("k0", ttl=t),
            "match_prefix": lambda t: c.ops.match_prefix(["k0"], ttl=t),
            "renew": lambda t: c.ops.renew([], ttl=t),
            "ring_reserve": lambda t: c.ops.ring_reserve(0, 4096, key="r", ttl=t),
            "replica": lambda t: c.ops.match_prefix(["k0"], ttl=t, hold=False),
        }
        for path, call in paths.items():
            for ttl in (math.nan, math.inf, -1.0, 0, 3601):
                with pytest.raises(BadRequest) as exc:
                    call(ttl)
                _, _, why = str(exc.value).partition(": ")
                refusals.setdefault(why, set()).add(path)
        assert c._replica is not None and c._replica.fallbacks == 0  # the replica answered
    assert all(why.startswith("ttl must be in (0, 3600] seconds, not ") for why in refusals)
    assert all(paths == set(refusals[next(iter(refusals))]) for paths in refusals.values())
    assert len(refusals) == 5, refusals  # one refusal per value, the same on every path
