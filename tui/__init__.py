"""``kvbroker tui``: a live Textual monitor. Installed as ``kvbroker.tui``."""
