"""A clone of the repository is a directory named kvbroker: Python started in the directory
that holds it takes the clone for the package (issue 19). Nothing of kvbroker runs in that
Python, so the fix is where kvbroker does run: `kvbroker doctor` names the directory, and
`python -m kvbroker` started there says so in one line. Each subprocess here runs in a
made-up clone's parent, and what the check says must be what Python really does there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ENV = {**os.environ, "KVBROKER_CONFIG": ""}
ENV.pop("PYTHONPATH", None)
ENV.pop("PYTHONSAFEPATH", None)


@pytest.fixture
def beside_a_clone(tmp_path):
    """tmp/kvbroker is a clone (no __init__.py, the package inside it); tmp holds it."""
    clone = tmp_path / "kvbroker"
    (clone / "kvbroker").mkdir(parents=True)
    (clone / "kvbroker" / "__init__.py").write_text("")
    (clone / "Makefile").write_text("")
    (tmp_path / "elsewhere").mkdir()
    return tmp_path


def _python(cwd, *args):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=ENV
    )


def _imports_client(cwd) -> bool:
    return _python(cwd, "-c", "from kvbroker import Client").returncode == 0


def _doctor_here(cwd, tmp_path) -> dict:
    script = shutil.which("kvbroker", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no kvbroker script beside this Python")
    r = subprocess.run(
        [script, "doctor", "--json", "--socket", str(tmp_path / "none.sock")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    return checks["python here"]


def test_doctor_says_what_python_started_beside_a_clone_gets(beside_a_clone):
    shadowed = not _imports_client(beside_a_clone)
    here = _doctor_here(beside_a_clone, beside_a_clone)
    assert here["status"] == ("warn" if shadowed else "ok"), here
    if shadowed:
        assert str(beside_a_clone / "kvbroker") in here["detail"]
        assert "unknown location" in here["detail"] and "python -P" in here["fix"]
        assert _python(beside_a_clone, "-P", "-c", "from kvbroker import Client").returncode == 0


def test_doctor_is_quiet_elsewhere_and_names_another_copy(beside_a_clone):
    elsewhere = beside_a_clone / "elsewhere"
    assert _imports_client(elsewhere)
    assert _doctor_here(elsewhere, beside_a_clone)["status"] == "ok"
    # Inside the made-up clone Python imports its (empty) package, not this installation.
    inside = _doctor_here(beside_a_clone / "kvbroker", beside_a_clone)
    assert inside["status"] == "warn"
    assert str(beside_a_clone / "kvbroker" / "kvbroker") in inside["detail"]


def test_python_m_kvbroker_beside_a_clone_says_why_in_one_line(beside_a_clone):
    if _imports_client(beside_a_clone):
        pytest.skip("this installation is not shadowed by a clone (not an editable install)")
    r = _python(
        beside_a_clone, "-m", "kvbroker", "ls", "--socket", str(beside_a_clone / "none.sock")
    )
    assert r.returncode != 0
    first = r.stderr.splitlines()[0]
    assert first.startswith("kvbroker: warning: this Python took")
    assert str(beside_a_clone / "kvbroker") in first and "python -P" in first
    # A command that needs nothing of the package face still runs, with the same warning.
    r = _python(beside_a_clone, "-m", "kvbroker", "--version")
    assert r.returncode == 0 and r.stdout.startswith("kvbroker ")
    assert r.stderr.startswith("kvbroker: warning: this Python took")


@pytest.mark.parametrize("name", ["kvbroker", "kvbroker-src"])
def test_make_serve_says_where_to_run_python_in_a_clone_named_kvbroker(tmp_path, name):
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    clone = tmp_path / name
    clone.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), os.pardir, "Makefile"), clone)
    r = subprocess.run(
        [make, "-n", "serve", "SOCKET=/tmp/k.sock", "RUNTIME_STAMP="],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    trap = f"run Python in this clone or anywhere but {tmp_path}: there 'import kvbroker'"
    assert (trap in r.stdout) == (name == "kvbroker"), r.stdout
