"""What besides the token ids goes into the connector's block keys (``request_salt`` in
kvbroker/integrations/vllm/_scheduler.py): the LoRA adapter and the multimodal inputs. KV
computed under one adapter, or beside one image, must never be served to a request with
another (or none), while requests with the same ones still share it.

vLLM's own Scheduler and the harness's worker connectors with a real daemon (as
tests/test_vllm_connector.py): a producer runs a prompt under a LoRA adapter, and a consumer
looks the same token ids up through vLLM's real ``Request`` objects with the same adapter,
another one, and none. The harness's fake model has no encoder, so multimodal requests are
looked up only: against blocks saved for the bare text, and salt against salt.
"""

from __future__ import annotations

import pytest

from tests.vllm_helpers.common import needs_vllm, tiny_model

pytestmark = needs_vllm

BLOCK = 32


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


P = _tokens(11, 100)  # 3 full blocks and a tail: a full hit is 99 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


def _engine(model, socket, role, monkeypatch):
    from tests.vllm_helpers.harness import Engine

    return Engine(model, role=role, socket=socket, monkeypatch=monkeypatch)


def _lora(name: str, int_id: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=f"/adapters/{name}")


def _image(identifier: str, offset: int, length: int = 16):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


_probes = 0


def _request(tokens, *, lora=None, images=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    global _probes
    _probes += 1
    return Request(
        request_id=f"probe-{_probes}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=lora,
        mm_features=images,
    )


def _matched(eng, request) -> int:
    n, _async = eng.connector.get_num_new_matched_tokens(request, 0)
    return n


def test_kv_computed_under_one_lora_adapter_is_served_only_to_that_adapter(
    model, broker, monkeypatch
):
    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch)
    prod.add(P, lora_request=_lora("adapter-a", 1))
    prod.run()
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    assert _matched(cons, _request(P, lora=_lora("adapter-a", 1))) == len(P) - 1
    assert _matched(cons, _request(P, lora=_lora("adapter-b", 2))) == 0
    assert _matched(cons, _request(P)) == 0  # the base model's KV is not the adapter's
    # ... and a consumer request under adapter-a loads it
    req = cons.add(P, lora_request=_lora("adapter-a", 1))
    steps = cons.run()
    loaded = sum(s.data.get("loaded_blocks", 0) for st in steps for s in st["stats"] if s)
    assert loaded == 4 and steps[0]["output"].num_scheduled_tokens[req] == 1
    prod.close()
    cons.close()


def test_kv_of_the_bare_text_is_not_served_to_a_request_with_an_image(model, broker, monkeypatch):
    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch)
    prod.add(P)
    prod.run()
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    assert _matched(cons, _request(P)) == len(P) - 1
    # the same token ids with an image in their placeholder positions: other KV
    assert _matched(cons, _request(P, images=[_image("img-1", offset=40)])) == 0
    prod.close()
    cons.close()


def test_images_key_by_content_and_position():
    from kvbroker.integrations.vllm._scheduler import request_salt

    def salt(images):
        return request_salt(_request(P, images=images))

    same = salt([_image("img-1", offset=40)])
    assert salt([_image("img-1", offset=40)]) == same  # the same image, same place: shared
    assert salt([_image("img-2", offset=40)]) != same  # another image
    assert salt([_image("img-1", offset=70)]) != same  # the same image elsewhere
    assert salt([_image("img-1", offset=40), _image("img-2", offset=70)]) != same
    assert salt(None) != same
