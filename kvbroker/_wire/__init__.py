"""The contract between the daemon and its clients: what both sides agree on.

Imports nothing of kvbroker but :mod:`kvbroker.errors`. ``protocol`` (the op table, frame
limits), ``objects`` (how buffers lie in an extent), ``checksum`` (the digest of a buffer),
``stats`` (the statistics types), ``names`` (KV buffer names), ``paths`` (the socket path and
the units used on the command line). See ``docs/design.md``.
"""
