"""docs/configuration.md is generated from the Key declarations (kvbroker._server.config_doc)."""

from __future__ import annotations

import pathlib

from kvbroker._server import config, config_doc

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_committed_reference_is_what_the_declarations_give():
    assert DOC.read_text() == config_doc.markdown(), (
        "docs/configuration.md is out of date: python -m kvbroker._server.config_doc"
    )
    assert config_doc.main(["--check"]) == 0


def test_every_setting_has_its_row_and_a_new_key_makes_the_page_stale(tmp_path, monkeypatch):
    text = config_doc.markdown()
    for key in config.SETTINGS:
        row = next(line for line in text.splitlines() if f"| `{key.env}` |" in line)
        assert ("| reload |" if key.reloadable else "| restart |") in row, key.name
        for flag in key.flags:
            assert f"`{flag}`" in row, (key.name, flag)
    assert "| `lease_ttl` | `30s` | `KVBROKER_LEASE_TTL` | `--lease-ttl` | reload |" in text
    assert "| `[transfer]` `listen` | `off` | `KVBROKER_TRANSFER_LISTEN` |" in text
    assert "/tmp/kvbroker-$UID.sock" in text  # the socket's default as a rule, not this machine's

    out = tmp_path / "configuration.md"
    out.write_text(text)
    assert config_doc.main(["--check", "--out", str(out)]) == 0
    new = config.Key("frobnicate", config.parse.boolean, False, help="Frobnicate the pools.")
    monkeypatch.setattr(config_doc, "SETTINGS", (*config.SETTINGS, new))
    # (its variable spelt through .env: test_config refuses undeclared names in the repository)
    row = f"| `frobnicate` | `false` | `{new.env}` | — | restart | Frobnicate the pools. |"
    assert row in config_doc.markdown().splitlines()
    assert config_doc.main(["--check", "--out", str(out)]) == 1
