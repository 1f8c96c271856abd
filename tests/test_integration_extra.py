"""The engines' extra config (kvbroker.integrations._extra): an unknown key is named, with
the key it was probably meant to be, and every key an adapter reads is one it knows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvbroker.integrations._extra import unknown_keys

ROOT = Path(__file__).resolve().parent.parent / "kvbroker" / "integrations"
VLLM_KEYS = ("socket", "namespace", "timeout", "load_async")
# SGLang's own keys in its --hicache-storage-backend-extra-config (0.5.23's factory and
# cache controller read these): never a kvbroker misspelling.
SGLANG_OWN = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "tp_lcm_size",
    "enable_metadata_cache",
    "metadata_ttl",
)


def test_a_misspelt_key_is_named_with_the_key_it_was_meant_to_be():
    extra = {"socket": "/s", "sock": "/s", "load_asnyc": True, "timeout": 5, "frobnicate": 1}
    lines = unknown_keys(extra, VLLM_KEYS)
    assert lines[0] == "'sock' (did you mean 'socket'?)"
    assert lines[1] == "'load_asnyc' (did you mean 'load_async'?)"
    assert lines[2].startswith("'frobnicate' (known: load_async, namespace, socket")
    assert len(lines) == 3
    assert unknown_keys({"socket": "/s", "load_async": False}, VLLM_KEYS) == []


def test_in_a_shared_dict_only_near_misses_are_named():
    sglang = _declared(ROOT / "sglang" / "storage.py")
    extra = {key: 1 for key in SGLANG_OWN} | {"socket": "/s", "cache-salt": "x", "timout": 5}
    assert unknown_keys(extra, sglang, shared=True) == [
        "'cache-salt' (did you mean 'cache_salt'?)",
        "'timout' (did you mean 'timeout'?)",
    ]


def test_every_key_an_adapter_reads_is_declared():
    """A key read but left out of EXTRA_KEYS would be logged as unknown while it works."""
    handoff = _declared(ROOT / "vllm" / "_handoff.py", "HANDOFF_KEYS")
    for declared, sources in (
        (
            _declared(ROOT / "vllm" / "connector.py", known={"HANDOFF_KEYS": handoff}),
            ["connector.py", "_handoff.py"],
        ),
        (_declared(ROOT / "sglang" / "storage.py"), ["../sglang/storage.py"]),
    ):
        read = {
            key
            for name in sources
            for key in re.findall(r"extra\.get\(\"(\w+)\"", (ROOT / "vllm" / name).read_text())
        }
        assert read and read <= set(declared), read - set(declared)


def _declared(path: Path, name: str = "EXTRA_KEYS", known: dict | None = None) -> tuple:
    """The strings of the tuple ``name`` in ``path`` (read, not imported: no engine needed);
    a starred name is taken from ``known``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            out: list[str] = []
            for elt in node.value.elts:
                if isinstance(elt, ast.Starred):
                    out += (known or {})[elt.value.id]
                else:
                    out.append(elt.value)
            return tuple(out)
    raise AssertionError(f"no {name} in {path}")
