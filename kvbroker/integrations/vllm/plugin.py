"""vLLM general plugin: makes ``"kv_connector": "KVBrokerConnector"`` name this connector
without ``kv_connector_module_path``.

Installed kvbroker declares it as the ``vllm.general_plugins`` entry point ``kvbroker``
(pyproject.toml); vLLM calls every such function in each of its processes (API server, engine
core, workers) before it resolves a connector name (``VLLM_PLUGINS``, a comma-separated
allow-list of plugin names, may leave it out). Registration is lazy (vLLM imports the
connector only when an engine asks for it), and calling it again is harmless.
"""

from __future__ import annotations

NAME = "KVBrokerConnector"
MODULE = "kvbroker.integrations.vllm.connector"


def register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:
        pass  # registered already: vLLM loaded its plugins in this process before
