"""The daemon side of the socket: pools, the directory of objects, leases, eviction.

``daemon`` (the asyncio server and its lifecycle) drives ``broker`` (the state machine: the
ownership contract is written once, in its docstring). Never imports :mod:`kvbroker._client`;
never maps the KV bytes. See ``docs/design.md``.
"""
