"""The contract between the daemon and its clients: what both sides agree on.

Imports nothing of kvbroker but :mod:`kvbroker.errors`. ``protocol`` (the op table, frame
limits), ``rules`` (an op's arguments: types, value rules, the replica column), ``frames``
(the one frame codec, sans I/O, that every speaker of the wire uses), ``ops`` (the typed op
stubs every asking side names ops through), ``replies`` (reply types), ``objects`` (how
buffers lie in an extent), ``checksum`` (the digest of a buffer), ``stats`` (the statistics
types), ``names`` (KV buffer names), ``paths`` (the socket path and the units used on the
command line). See ``docs/design.md``.
"""
