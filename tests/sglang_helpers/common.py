"""Helpers of the SGLang tests: the skip rule and engine processes (tests/sglang_helpers/engine.py).

The test process itself never imports SGLang: SGLang patches transformers at import, and its
torchvision stub would make transformers believe torchvision is installed, for every test
after it. Each engine is its own process, as each SGLang engine is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sglang_skip_reason() -> str | None:
    """Why the SGLang tests cannot run here, or None when they can."""
    if importlib.util.find_spec("sglang") is None:
        try:
            import torch

            have = f"torch {torch.__version__}"
        except ImportError:
            have = "no torch"
        return (
            f"SGLang is not installed ({have}): `make test` installs sglang==0.5.23 "
            "(without its CUDA requirements) only beside the CPU build of torch, so a GPU "
            "host keeps its own torch; install SGLang yourself to run these tests there"
        )
    return None


needs_sglang = pytest.mark.skipif(
    sglang_skip_reason() is not None, reason=sglang_skip_reason() or ""
)


class Engine:
    """One engine process; :meth:`call` sends a command and returns its reply."""

    def __init__(self, log_path: Path, env: dict | None = None, start_timeout: float = 240):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang_helpers.engine"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                **(env or {}),
            },
        )
        self._buffer = b""
        assert self._reply(start_timeout).get("ready"), self.tail()

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.startswith(b"@@"):
                    return json.loads(line[2:])
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()
                pytest.fail(f"engine gave no reply in {timeout} s:\n{self.tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    pytest.fail(f"engine exited ({self.proc.wait()}):\n{self.tail()}")
                self._buffer += chunk

    def call(self, op: str, timeout: float = 120, **args) -> dict:
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        if not reply.pop("ok"):
            pytest.fail(
                f"engine {op} failed: {reply['error']}\n{reply['traceback']}\n{self.tail()}"
            )
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
