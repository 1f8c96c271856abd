"""The repository stands on its own: no tracked file points outside it (issue #17).

The project's machines have a folder beside the checkout (``shared``) that users do not
have; a default, a command or a set-up step that reaches into it works only there. The
strings are built here from pieces so that this file does not match itself.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTSIDE = ("../" + "shared", "shared" + "/peers")


def _git_grep(root: pathlib.Path, needle: str) -> list[str]:
    """Lines of tracked files (text only) that contain ``needle``, as ``path:line:text``."""
    p = subprocess.run(
        ["git", "grep", "-n", "-I", "-F", "-e", needle],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode not in (0, 1):  # 1: no match
        raise RuntimeError(p.stderr)
    return p.stdout.splitlines()


@pytest.fixture(scope="module")
def checkout() -> pathlib.Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the rule is about tracked files)")
    return ROOT


@pytest.mark.parametrize("needle", OUTSIDE)
def test_no_tracked_file_points_outside_the_repository(checkout, needle):
    hits = "\n".join(_git_grep(checkout, needle))
    assert not hits, f"tracked files point at {needle!r}, outside the repository:\n{hits}"


def test_the_rule_sees_a_violation(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.md").write_text("set-up: " + OUTSIDE[0] + "/peers/README.md\n")
    (tmp_path / "b.md").write_text("nothing here\n")
    subprocess.run(["git", "add", "a.md", "b.md"], cwd=tmp_path, check=True)
    assert [h.split(":")[0] for h in _git_grep(tmp_path, OUTSIDE[0])] == ["a.md"]
    assert [h.split(":")[0] for h in _git_grep(tmp_path, OUTSIDE[1])] == ["a.md"]
