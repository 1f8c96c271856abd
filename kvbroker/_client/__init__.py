"""The client side of the socket: one connection to the daemon, and the bytes it moves.

Layers, each using only the one below it: ``transport`` (the Unix socket) → ``framing``
(msgpack frames) → ``session`` (hello, request ids, replies in order) → ``client`` (the
synchronous :class:`~kvbroker.Client` facade, leases, arenas). Never imports
:mod:`kvbroker._server`. See ``docs/design.md``.
"""
