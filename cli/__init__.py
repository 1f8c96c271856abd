"""The ``kvbroker`` command (Typer). Installed as ``kvbroker.cli``."""

from ._app import app, main

__all__ = ["app", "main"]
