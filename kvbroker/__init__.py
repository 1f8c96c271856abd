"""kvbroker: a node-local KV-cache broker for disaggregated LLM serving.

The daemon (``kvbroker serve``) owns shared-memory pools and hands out leases on slices of
them; engines publish prefill KV and claim it for decode through :class:`Client`, moving the
bytes themselves through their own mapping of the pools. See ``kvbroker._server.broker`` for the
lease and claim semantics, ``kvbroker._wire.protocol`` for the wire protocol.
"""

from ._client.client import Client, EvictResult, ReadLease, WriteLease
from ._wire.stats import (
    ClientStatistics,
    Counters,
    LeaseInfo,
    NamespaceUsage,
    ObjectInfo,
    PoolStatistics,
    Statistics,
    TransferRecord,
)
from ._version import __version__
from .errors import (
    BadRequest,
    BrokerUnavailable,
    ChecksumMismatch,
    Exists,
    Forbidden,
    Incomplete,
    InternalError,
    KVBrokerError,
    LayoutMismatch,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    PeerUnavailable,
    PoolFull,
    ProtocolError,
    QuotaExceeded,
    Timeout,
    TransferFailed,
)

__all__ = [
    "Client",
    "WriteLease",
    "ReadLease",
    "EvictResult",
    "Statistics",
    "PoolStatistics",
    "ClientStatistics",
    "LeaseInfo",
    "TransferRecord",
    "Counters",
    "ObjectInfo",
    "NamespaceUsage",
    "KVBrokerError",
    "BadRequest",
    "ProtocolError",
    "NotFound",
    "Exists",
    "Incomplete",
    "PoolFull",
    "LeaseExpired",
    "Timeout",
    "Forbidden",
    "QuotaExceeded",
    "LimitExceeded",
    "ChecksumMismatch",
    "LayoutMismatch",
    "BrokerUnavailable",
    "PeerUnavailable",
    "TransferFailed",
    "InternalError",
    "__version__",
]

# KV layouts and heterogeneous tensor parallelism (kvbroker.layout, kvbroker.kv); no torch import.
from .kv import ClaimResult, PagedKV, PublishResult, claim_shards, publish_shard, shard_key  # noqa: E402
from .layout import Layout  # noqa: E402

__all__ += [
    "Layout",
    "PagedKV",
    "PublishResult",
    "ClaimResult",
    "publish_shard",
    "claim_shards",
    "shard_key",
]
