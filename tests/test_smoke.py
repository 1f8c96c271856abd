import numpy as np


def test_put_claim_roundtrip(client):
    data = np.arange(4096, dtype=np.int32)
    assert client.put("k", {"past_key.0": data, "tag": b"xyz"}, meta={"layers": 1})
    with client.claim("k") as lease:
        assert lease.meta == {"layers": 1}
        assert np.array_equal(lease["past_key.0"].view(np.int32), data)
        assert bytes(lease["tag"]) == b"xyz"
