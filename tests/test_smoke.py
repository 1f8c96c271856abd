import numpy as np


def test_put_claim_roundtrip(client):
    data = np.arange(4096, dtype=np.int32)
    assert client.put("k", {"past_key.0": data, "tag": b"xyz"}, meta={"layers": 1})
    with client.claim("k") as lease:
        assert lease.meta == {"layers": 1}
        assert np.array_equal(lease["past_key.0"].view(np.int32), data)
        assert bytes(lease["tag"]) == b"xyz"


def test_read_lease_views_stay_read_only(client):
    """A read lease lends read-only views: the claimed object may be another reader's too,
    so a view cannot be made writable again either."""
    import pytest

    client.put("ro", {"kv": np.arange(1024, dtype=np.uint8)})
    with client.claim("ro") as lease:
        view = lease["kv"]
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view.flags.writeable = True
        with pytest.raises(ValueError):
            view[0] = 1
    with client.reserve("rw", {"kv": 16}) as w:
        w["kv"][:] = 7  # a write lease's views are writable
    assert client.get("rw")["kv"].tolist() == [7] * 16
