"""Adapters between kvbroker and inference engines.

Each adapter is its own module and imports its engine lazily: ``import kvbroker`` and
``import kvbroker.integrations`` import neither torch nor any engine.

- :mod:`kvbroker.integrations.transformers`: Hugging Face transformers ``Cache`` objects
  (publish under a request key, as head shards for heterogeneous TP, or as prefix blocks;
  rebuild a ``DynamicCache`` from a claim).
- :mod:`kvbroker.integrations.vllm`: ``KVBrokerConnector``, a vLLM KV connector (P/D handoff
  and prefix reuse across engines on a node; ``"kv_connector": "KVBrokerConnector"``, found
  through the ``vllm.general_plugins`` entry point, or with ``kv_connector_module_path=
  "kvbroker.integrations.vllm"``). Importing the package does not import vLLM.
"""

__all__: list[str] = []
