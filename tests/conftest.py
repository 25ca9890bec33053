"""Shared test helpers: run a worker script under torchrun with N gloo processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Megatron-Core wraps its fused kernels (bias-GeLU, SwiGLU, RoPE, ...) in torch.compile when imported, and the
# first wrap imports Inductor: 0.8 s of CPU in every one of the hundreds of processes the suite starts
# (torchrun ranks, Slurm jobs, the demo), 15% of a two-rank training run's CPU time. No CPU path of ours calls
# those kernels (a 3-step CP 2 run gives bit-identical losses and grad norms either way), so without CUDA the
# suite turns TorchDynamo off; its subprocesses inherit the setting. Where CUDA is, tests/gpu keep it on.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: int = 600, module: bool = False) -> str:
    """Run `script` (a path, or a module with module=True) on `nproc` local processes; return stdout.

    Two or more start under torchrun; one runs as a plain `python` process, the way a laptop user starts
    it (the launcher's own start-up, importing torch, is a third of a small one-process run here).
    Fails the test with the combined output when the job exits non-zero.
    """
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
                "--master_addr=127.0.0.1"]
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
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed("cpu", seed=1234)
    for key, value in saved.items():  # the group exists: do not hand its port to subprocesses we start
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    yield
    destroy_distributed()


@pytest.fixture(scope="session")
def toy_tokenizer(tmp_path_factory):
    """The package's toy byte-level BPE tokenizer (512 ids, the tiny preset's vocabulary)."""
    from megatron_ext.data.toy import build_toy_tokenizer

    return str(build_toy_tokenizer(tmp_path_factory.mktemp("tok")))


def _cpt_data(folder: Path, tokenizer: str, documents: int, seed: int) -> str:
    """A CPT indexed dataset prepared by the real pipeline from a synthetic corpus, `<s>`-separated."""
    from megatron_ext.data import prepare_cpt
    from megatron_ext.data.toy import synthetic_corpus, write_jsonl

    corpus = write_jsonl(folder / "corpus.jsonl", synthetic_corpus(documents, seed=seed))
    prepare_cpt([str(corpus)], tokenizer, str(folder / "cpt"), progress=False)
    return str(folder / "cpt")


@pytest.fixture(scope="session")
def token_data(tmp_path_factory, toy_tokenizer):
    """The CPT dataset of the tests (120 synthetic documents)."""
    return _cpt_data(tmp_path_factory.mktemp("data"), toy_tokenizer, 120, seed=0)


@pytest.fixture(scope="session")
def second_token_data(tmp_path_factory, toy_tokenizer):
    """Another CPT dataset (another synthetic corpus), to blend with token_data."""
    return _cpt_data(tmp_path_factory.mktemp("data2"), toy_tokenizer, 60, seed=5)


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory, toy_tokenizer):
    """An SFT dataset (chat samples, loss on assistant tokens) prepared by the real pipeline."""
    from megatron_ext.data import prepare_sft
    from megatron_ext.data.toy import synthetic_chats, write_jsonl

    d = tmp_path_factory.mktemp("sft")
    chats = write_jsonl(d / "chats.jsonl", synthetic_chats(200, seed=0))
    prepare_sft([str(chats)], toy_tokenizer, str(d / "sft"), seq_length=256, progress=False)
    return str(d / "sft")
