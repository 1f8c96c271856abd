"""kvbroker as an SGLang HiCache storage backend, loaded by SGLang's ``dynamic`` backend:

::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvbroker",
        "module_path": "kvbroker.integrations.sglang", "class_name": "KVBrokerStorage",
        "interface_v1": 1, "socket": "/run/kvbroker/kvbroker.sock"}'

See :mod:`.storage` for the extra config's keys and what the backend does. Importing this
package does not import SGLang: ``KVBrokerStorage`` is loaded from :mod:`.storage` on first
access (SGLang's loader does exactly that), so :mod:`._format` and :mod:`._pages` can be used
and tested without SGLang. Tested with SGLang 0.5.23 (its HiCache interface moves between
releases).
"""

from __future__ import annotations

__all__ = ["KVBrokerStorage"]


def __getattr__(name: str):
    if name in __all__:
        from . import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
