"""Shared test helpers: run a worker script under torchrun with N gloo processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: int = 600, module: bool = False) -> str:
    """Run `script` (a path, or a module with module=True) on `nproc` local processes; return stdout.

    Fails the test with the combined output when the job exits non-zero.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", "--master_addr=127.0.0.1"]
    cmd += ["-m", str(script)] if module else [str(script)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def cpu_parallel_state():
    """A single-process gloo group with Megatron parallel state (TP=PP=CP=1), CPU backend applied."""
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed("cpu", seed=1234)
    yield
    destroy_distributed()


@pytest.fixture(scope="session")
def token_data(tmp_path_factory):
    """Documents that repeat a random motif (learnable only by attending back), via Megatron-Core's builder."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    d = tmp_path_factory.mktemp("data")
    gen = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(d / "docs.bin"), dtype=np.int32)
    for _ in range(40):
        n = int(gen.integers(20, 300))
        motif = gen.integers(3, 512, int(gen.integers(4, 24)))
        doc = np.resize(motif, n).astype(np.int32)
        builder.add_document(torch.from_numpy(doc), [n])
    builder.finalize(str(d / "docs.idx"))
    return str(d / "docs")
