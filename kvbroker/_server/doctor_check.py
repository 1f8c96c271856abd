"""What one ``kvbroker doctor`` check found: its status, what it saw, the fix to paste."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)
