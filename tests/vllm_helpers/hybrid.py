"""Helpers of the hybrid-model engine tests (tests/test_vllm_hybrid_*.py): how many blocks a
prompt has in a KV cache group, how many of a sliding group's a prefix hit needs, and zeroing
stored blocks in the broker to show which ones an engine read."""

from __future__ import annotations

HMA_OFF = "Turning off hybrid kv cache manager"  # what vLLM logs when it turns HMA off


def group_blocks(n: int, block: int) -> int:
    """Blocks (full ones and the tail) a prompt of ``n`` tokens has in a group of ``block``-token
    blocks."""
    return n // block + (1 if (n - 1) % block and n % block else 0)


def window_blocks(hit: int, block: int, window: int) -> int:
    """Blocks of one sliding group (``window`` tokens, ``block``-token blocks) a prefix hit of
    ``hit`` tokens needs: those under the window of its last token."""
    return -(-hit // block) - max(0, hit - window + 1) // block


def zero_blocks(client, prompt, block: int, *, groups, blocks, namespace=None) -> int:
    """Overwrite with zeros blocks ``blocks`` (indices, ``prompt`` cut in ``block``-token
    blocks) of ``prompt`` in groups ``groups``; how many objects were overwritten.
    ``namespace``: by default the one the broker holds."""
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    if namespace is None:
        (namespace,) = {o.namespace for o in client.list()}
    keys = prompt_keys(prompt, block, namespace=namespace, cache_salt="").keys
    wanted = {f"{keys[b]}.g{g}" for g in groups for b in blocks}
    hit = 0
    for obj in client.list(namespace=namespace):
        if obj.key.split("/")[0] in wanted:
            with client.claim(obj.key, namespace=namespace) as lease:
                for view in host_tensors(lease).values():  # writable on purpose
                    view.zero_()
            hit += 1
    return hit
