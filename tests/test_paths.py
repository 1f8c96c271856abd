import os

import pytest

from kvbroker._wire.paths import default_socket_path, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("4k", 4096),
        ("1G", 1 << 30),
        ("512MiB", 512 << 20),
        ("1GB", 10**9),
        ("1.5g", 3 << 29),
        (7, 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1Q", "-1G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    "text,expected",
    [("30s", 30), ("5m", 300), ("1h30m", 5400), ("2d", 172800), ("0.5", 0.5), ("250ms", 0.25)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "soon", "5x", "m5"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_default_socket_path(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBROKER_SOCKET", "/x/y.sock")
    assert default_socket_path() == "/x/y.sock"
    monkeypatch.delenv("KVBROKER_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "kvbroker.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() in (
        "/run/kvbroker/kvbroker.sock",
        f"/tmp/kvbroker-{os.geteuid()}.sock",
    )


def test_format_size():
    assert format_size(512) == "512 B" and format_size(3 << 30) == "3.0 GiB"
