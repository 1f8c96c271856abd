"""kvbroker as a vLLM KV connector (``kv_connector="KVBrokerConnector"``, found through the
``vllm.general_plugins`` entry point of :mod:`.plugin`, or with
``kv_connector_module_path="kvbroker.integrations.vllm"``); see :mod:`.connector`.

Importing this package does not import vLLM: ``KVBrokerConnector`` (and the metadata and
stats classes) are loaded from :mod:`.connector` on first access, so the vLLM-free parts
(:mod:`._paged`, :mod:`._format`, :mod:`._cuda`) can be used and tested without vLLM.
Tested with vLLM 0.32.0 and 0.33.0's Python sources (the connector API is experimental).
"""

from __future__ import annotations

import logging

# The connector's logger (its modules log through it; kvbroker.integrations._link's
# warnings go to it too, the connector hands it its Warnings).
log = logging.getLogger(__name__)

__all__ = ["KVBrokerConnector", "KVBrokerMetadata", "KVBrokerStats"]


def __getattr__(name: str):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
