"""doctor's check of what ``python`` started in the current directory takes for kvbroker.

A clone of the repository is a directory named ``kvbroker``. Python started in the directory
that holds it puts that directory first on ``sys.path``; with the editable install ``make``
does, setuptools serves the package through a finder that Python asks only after the path,
so the clone is taken for an empty namespace package: "cannot import name 'Client' from
'kvbroker' (unknown location)". None of kvbroker runs in that Python to say why; this check
finds it by asking the path finder what that Python would get.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

__all__ = ["python_here_check", "shadowing_directory", "shadowed_message"]

NAME = "python here"
FIX = (
    "start Python inside the clone or in any other directory, or with 'python -P' (the "
    "current directory left off the path)"
)


def shadowing_directory() -> str | None:
    """The directory this very process took for the kvbroker package, when it is not one (a
    namespace package: ``python -m kvbroker`` started beside a clone); else None."""
    pkg = sys.modules.get("kvbroker")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return None
    return next(iter(getattr(pkg, "__path__", [])), "?")


def shadowed_message(where: str) -> str:
    return (
        f"kvbroker: warning: this Python took {where} (a directory without __init__.py: a "
        f"clone of kvbroker?) for the kvbroker package; {FIX}"
    )


def python_here_check(cwd: str | None = None):
    """What ``import kvbroker`` gets in a Python of this interpreter started in ``cwd``."""
    import kvbroker
    from kvbroker._server.doctor import Check

    cwd = os.path.abspath(cwd or os.getcwd())
    if getattr(kvbroker, "__file__", None) is None:  # this process is shadowed itself
        return Check(NAME, "warn", shadowed_message(shadowing_directory() or "?"), FIX)
    ours = os.path.dirname(os.path.abspath(kvbroker.__file__))
    # This process's path less its own first entry (the script's directory, or the directory
    # `python -m` started in), with the directory a plain `python` would put there instead.
    rest = sys.path if getattr(sys.flags, "safe_path", False) else sys.path[1:]
    spec = PathFinder.find_spec("kvbroker", [cwd, *rest])
    if spec is not None and spec.origin is None and spec.submodule_search_locations:
        where = list(spec.submodule_search_locations)[0]
        return Check(
            NAME,
            "warn",
            f"python started in {cwd} takes {where} (a directory without "
            f"__init__.py: a clone of kvbroker?) for the package: "
            f"'from kvbroker import Client' fails there (unknown location)",
            FIX,
        )
    if spec is not None and spec.origin is not None:
        found = os.path.dirname(os.path.abspath(spec.origin))
        if not os.path.exists(ours) or not os.path.samefile(found, ours):
            return Check(
                NAME,
                "warn",
                f"python started in {cwd} imports kvbroker from {found}, not this "
                f"installation's ({ours})",
                "start Python in another directory, or install that copy into this "
                "environment ('pip install -e' in its clone)",
            )
    return Check(NAME, "ok", f"python started in {cwd} imports this kvbroker ({ours})")
