"""kvbroker's ``vllm.general_plugins`` entry point (pyproject.toml): with kvbroker installed,
vLLM's own plugin loading registers the connector, so ``"kv_connector": "KVBrokerConnector"``
resolves without ``kv_connector_module_path``. A fresh interpreter each time (vLLM loads its
plugins once per process); tests/test_vllm_e2e.py's prefix-reuse engines are configured so.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.vllm_helpers.common import ROOT, needs_vllm

pytestmark = needs_vllm

RESOLVE = """
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

load_general_plugins()
config = KVTransferConfig(kv_connector="KVBrokerConnector", kv_role="kv_both")
cls = KVConnectorFactory.get_connector_class(config)
from kvbroker.integrations.vllm.plugin import register_connector

register_connector()  # again, as another of vLLM's processes would: harmless
register_connector()
assert KVConnectorFactory.get_connector_class(config) is cls
print("resolved", cls.__module__, cls.__name__)
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**clean, "VLLM_NO_USAGE_STATS": "1", **env},
        timeout=300,
        check=False,
    )


def test_vllm_resolves_the_connector_by_name_through_the_entry_point():
    done = _run(RESOLVE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resolved kvbroker.integrations.vllm.connector KVBrokerConnector" in done.stdout


def test_without_the_plugin_the_name_alone_does_not_resolve():
    """The control: with kvbroker's plugin left out (VLLM_PLUGINS names another), vLLM does
    not know the name, so the test above passes because of the entry point."""
    code = RESOLVE.split("cls = ")[0] + (
        "try:\n"
        "    KVConnectorFactory.get_connector_class(config)\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n"
    )
    done = _run(code, VLLM_PLUGINS="lora_filesystem_resolver")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused" in done.stdout and "KVBrokerConnector" in done.stdout
