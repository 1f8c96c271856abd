"""The client side of the socket: one connection to the daemon, and the bytes it moves.

Layers, each using only the one below it: ``transport`` (the Unix socket) → ``framing``
(msgpack frames) → ``session`` (hello, request ids, replies in order) → ``client`` (the
synchronous :class:`~kvbroker.Client` facade: reconnects, pool ``mappings``, ``leases``, the
write ``arena``). ``ops`` is the vocabulary beside them: one typed stub per op over a call
function, the only client code that names an op (the session greets with it, the client
makes every other request with it, as ``client.ops``). On top, the faces' machinery:
``shards`` and ``paged`` (:mod:`kvbroker.kv`), ``prefix_match`` (:mod:`kvbroker.prefix`),
``gpu_client``, ``gpu_rings``, ``gpu_copy``, ``gpu_shards`` and ``kernels``
(:mod:`kvbroker.gpu`); ``tp`` is pure head-sharding arithmetic. Never imports
:mod:`kvbroker._server`. See ``docs/design.md``.
"""
