"""What an operator sees of the disk tier ([tier.disk], issue 42): ``list`` (the client's,
``kvbroker ls``) shows the objects on disk too, with the tier each is in, filtered by tier as
``evict --tier`` picks them, paged without listing one twice, and only to those who may read
their namespace."""

from __future__ import annotations

import json
import os

import pytest

from kvbroker import BadRequest
from test_cli import run
from test_disk_daemon import daemons, pattern, tier_env, wait_for  # noqa: F401 (a fixture)


def test_list_shows_the_disk_tier(daemons, tmp_path):  # noqa: F811
    # No write-back ahead of eviction (watermark 1): no copy is being made in the background
    # between two listings; objects reach the disk by demotion, and dram+disk by promotion.
    d = daemons(tier_env(tmp_path / "disk", writeback_watermark="1"))
    with d.client() as c:
        keys = [f"obj{i}" for i in range(40)]  # 10 MiB through a 4 MiB pool
        for k in keys:
            assert c.put(k, {"past_key.0": pattern(k)})
        st = c.stat()
        on_disk_only = st.disk.only_on_disk
        assert on_disk_only > 0 and st.objects < len(keys)

        listed = c.list()
        assert [o.key for o in listed] == keys  # every one, once, in the order sealed
        tiers = {o.key: o.tier for o in listed}
        assert sum(t == "disk" for t in tiers.values()) == on_disk_only
        assert {t for t in tiers.values()} <= {"dram", "disk", "dram+disk"}
        in_pools = {o.key for o in c.list(tier="dram")}
        assert len(in_pools) == st.objects and all(tiers[k] != "disk" for k in in_pools)
        with_copy = {o.key for o in c.list(tier="disk")}
        assert with_copy == {k for k, t in tiers.items() if t != "dram"}
        disk_info = next(o for o in listed if o.tier == "disk")
        assert disk_info.pool == -1 and disk_info.nbytes == len(pattern(disk_info.key))

        # Pages: each object once, across the tiers' boundary.
        pages = list(c.list_pages(page_size=7))
        assert [o.key for p in pages for o in p] == keys and len(pages) == 6

        # A claim of one on disk brings it back: listed in a pool, once.
        k = disk_info.key
        c.get(k)
        again = c.list()
        assert sorted(o.key for o in again) == sorted(keys)
        assert next(o for o in again if o.key == k).tier == "dram+disk"  # the tiers are inclusive

        # evict --tier dram moves them to disk: listed as such.
        c.evict(match=".", tier="dram")
        assert {o.tier for o in c.list()} == {"disk"} and not c.list(tier="dram")

    s = d.socket_path
    rows = json.loads(run("ls", "--json", "-s", s).stdout)
    assert len(rows) == len(keys) and {r["tier"] for r in rows} == {"disk"}
    text = run("ls", "--tier", "disk", "--match", "^obj1$", "-s", s).stdout.splitlines()
    assert text[0].split()[-1] == "TIER" and text[1].split()[-1] == "disk"
    assert run("ls", "--tier", "dram", "--no-header", "-s", s).stdout.strip() == ""
    bad = run("ls", "--tier", "nvme", "-s", s)
    assert bad.exit_code == 2 and "--tier must be all, dram or disk" in bad.output


def test_list_tier_disk_without_a_disk_tier_is_an_error(client):
    client.put("x", {"a": b"x"})
    assert [(o.key, o.tier) for o in client.list()] == [("x", "dram")]
    assert client.list(tier="dram")[0].key == "x"
    with pytest.raises(BadRequest, match="list: this daemon has no disk tier"):
        client.list(tier="disk")
    with pytest.raises(BadRequest, match="list: tier must be one of all, dram, disk"):
        client.list(tier="ssd")


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runs a client as another uid)")
def test_a_tenant_lists_its_own_disk_objects_only(tmp_path):
    import shutil
    import tempfile

    from conftest import DaemonProcess
    from kvbroker import Client
    from kvbroker._server.policy import user_name
    from test_isolation import _as_user

    cfg = tmp_path / "iso.toml"
    cfg.write_text('[isolation]\nmode = "tenant"\n')
    where = tempfile.mkdtemp(prefix="kvb-disk-", dir="/tmp")
    os.chmod(where, 0o755)  # only the socket's mode keeps others out (tmp_path is 0700)
    d = DaemonProcess(
        os.path.join(where, "kvb.sock"),
        *("--config", str(cfg), "--pool-size", "4M", "--page-size", "4K"),
        *("--group", str(NOBODY), "--read-replicas", "0"),
        env=tier_env(tmp_path / "disk"),
    )
    me = user_name(NOBODY)
    try:
        with d.client() as root:
            for i in range(24):  # 6 MiB: the first ones go to disk
                root.put(f"root{i}", {"past_key.0": pattern(f"root{i}")})
                root.put(f"mine{i}", {"past_key.0": pattern(f"mine{i}")}, namespace=me)
            assert root.stat().disk.only_on_disk > 0
            everything = root.list()
            assert {o.namespace for o in everything if o.tier == "disk"} == {"default", me}

        def tenant():
            with Client(d.socket_path, timeout=10) as c:
                return {
                    "all": [[o.namespace, o.key, o.tier] for o in c.list()],
                    "default": len(c.list(namespace="default")),
                    "disk": [[o.namespace, o.key] for o in c.list(tier="disk")],
                }

        out = _as_user(NOBODY, NOBODY, tenant)
        assert {ns for ns, _, _ in out["all"]} == {me}
        assert sorted(k for _, k, _ in out["all"]) == sorted(f"mine{i}" for i in range(24))
        assert any(t == "disk" for _, _, t in out["all"])
        assert out["default"] == 0 and out["disk"] and {ns for ns, _ in out["disk"]} == {me}
    finally:
        d.stop()
        shutil.rmtree(where, ignore_errors=True)
