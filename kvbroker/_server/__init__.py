"""The daemon side of the socket: pools, the directory of objects, leases, eviction.

``daemon`` (the asyncio server and its lifecycle) accepts a ``connection`` per client,
which hands each request to ``broker``: the dispatch derived from the op table
(``kvbroker._wire.protocol.OPS``) and the state transitions, with ``handlers`` (one per op
row), ``pages`` (placement, allocation and eviction, the occupancy map, the timed
quarantine) and ``accounts`` (quota charges), which the broker composes, ``arenas``,
``restore`` (warm restart), ``leases`` (the lease registry), ``rings`` (GPU staging rings)
and ``snapshot`` (the statistics); ``config`` (with ``config_values``) declares the settings,
``fleet`` (with ``fleet_serving``) pulls from and serves peer brokers. The ownership
contract is written once, in ``state``'s docstring. Never imports :mod:`kvbroker._client`;
never maps the KV bytes. See ``docs/design.md``.
"""
