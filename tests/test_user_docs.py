"""The README and the user guide stay users' documents: short, and free of the measurement
history (commit hashes belong to docs/performance.md, which names the run of each table)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# every page of docs/ but performance.md, whose tables name the commit they were measured at
USER_DOCS = ["README.md"] + sorted(
    f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md") if page.name != "performance.md"
)
# a git commit as the repository's texts cite one: 7 to 40 hex digits, letters and digits mixed
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/ (aim <= 300)"


def test_no_commit_hashes_in_the_users_documents():
    found = {
        path: COMMIT.findall((ROOT / path).read_text())
        for path in USER_DOCS
        if COMMIT.search((ROOT / path).read_text())
    }
    assert not found, f"commit hashes (figures go to docs/performance.md): {found}"


def test_the_pattern_finds_what_the_old_readme_carried():
    assert COMMIT.findall("at b7ae53a, 0.85× at 47469c5 and at 354800f") == [
        "b7ae53a",
        "47469c5",
        "354800f",
    ]
    assert not COMMIT.findall("mode 0660, 1048576 bytes, deadbeef-free, cafe")
