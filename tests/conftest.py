"""Shared test helpers: run a worker script as N gloo processes (as torchrun starts them)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from megatron_ext.runtime.job_env import free_port
from tests import prefork

ROOT = Path(__file__).resolve().parents[1]

# Megatron-Core wraps its fused kernels (bias-GeLU, SwiGLU, RoPE, ...) in torch.compile when imported, and the
# first wrap imports Inductor: 0.8 s of CPU in every one of the hundreds of processes the suite starts
# (torchrun ranks, Slurm jobs, the demo), 15% of a two-rank training run's CPU time. No CPU path of ours calls
# those kernels (a 3-step CP 2 run gives bit-identical losses and grad norms either way), so without CUDA the
# suite turns TorchDynamo off; its subprocesses inherit the setting. Where CUDA is, tests/gpu keep it on.
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: int = 600, module: bool = False,
                 launcher: str = "direct") -> str:
    """Run `script` (a path, or a module with module=True) on `nproc` local processes; return stdout.

    By default the processes start the way torchrun starts its workers, from here: each with torchrun's
    environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), all writing to one
    stdout and one stderr, and when one fails the others are killed. torchrun's own agent process imports torch
    before it starts anyone, 3.4 s of every run on this machine (a third of a small two-rank run). One process
    runs as plain `python`, the way a laptop user starts it. Without CUDA each process is a fork of a server
    that has already imported torch and Megatron-Core (tests/prefork.py: 3-4 s of CPU less per rank;
    MEGATRON_EXT_PREFORK=0 starts plain subprocesses). `launcher="torchrun"` uses the real torchrun (the Slurm
    tests compare sbatch with it; the demo and the Slurm jobs use torchrun and srun themselves).
    Fails the test with the combined output when any process exits non-zero.
    """
    program = ["-m", str(script)] if module else [str(script)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", *program, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        codes, stdout, stderr = [proc.returncode], proc.stdout, proc.stderr
    else:
        codes, stdout, stderr = _run_ranks([sys.executable, "-u", *program, *args], nproc, env, timeout)
    if any(codes):
        pytest.fail(f"{script} on {nproc} process(es) exited {codes}\n--- stdout\n{stdout[-4000:]}\n"
                    f"--- stderr\n{stderr[-6000:]}")
    return stdout


RANK_EXIT_GRACE_S = 20.0  # after one rank failed, how long the others have to exit on their own


def _run_ranks(cmd: list[str], nproc: int, env: dict, timeout: float) -> tuple[list[int], str, str]:
    """`cmd` as ranks 0..nproc-1 of one job (nproc 1: no rendezvous variables); (exit codes, stdout, stderr)."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
                      "LOCAL_WORLD_SIZE": str(nproc)}
        envs = [env if nproc == 1 else {**env, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)}
                for r in range(nproc)]
        # Where CUDA is, plain processes: the server's imports may initialise the CUDA driver (is_available), and
        # a process forked after that cannot use CUDA.
        if prefork.enabled() and not CUDA and cmd[:2] == [sys.executable, "-u"]:
            server = _prefork_server(env)
            procs = [_ForkedRank(server, server.start(cmd[2:], e, str(out), str(err))) for e in envs]
        else:
            with open(out, "a") as stdout, open(err, "a") as stderr:
                procs = [subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=ROOT, env=e) for e in envs]
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() for p in procs)
            if failed:
                # The others would wait in a collective for its timeout, unless they saw the failure too and are
                # exiting with their own code (a user error all ranks agree on): given a few seconds, which a busy
                # machine needs (killed at once, a rank slow to exit read -9 where the test expects 1).
                deadline = min(deadline, time.time() + RANK_EXIT_GRACE_S)
            if time.time() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                if not failed:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        return [p.wait() for p in procs], out.read_text(), err.read_text()


_PREFORK: list[prefork.Prefork] = []  # the server of the last environment
atexit.register(lambda: _PREFORK and _PREFORK.pop().close())


def _prefork_server(env: dict) -> prefork.Prefork:
    """The prefork server started with `env` (a new one when the environment changed, pytest's name of the test
    in PYTEST_CURRENT_TEST aside, or when the last one has died)."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}
    if _PREFORK and (_PREFORK[0].env != env or _PREFORK[0].proc.poll() is not None):
        _PREFORK.pop().close()
    if not _PREFORK:
        _PREFORK.append(prefork.Prefork(env, ROOT))
    return _PREFORK[0]


class _ForkedRank:
    """A rank forked by the prefork server, with the part of Popen's interface _run_ranks uses."""

    def __init__(self, server: prefork.Prefork, pid: int):
        self.server, self.pid = server, pid

    def poll(self) -> int | None:
        return self.server.returncode(self.pid)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile
            pass

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.02)
        return code


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 kB file system (tmpfs) at tmp_path/full, for the out-of-space paths (ENOSPC); unmounted after.
    Skips where it cannot be mounted (not root, no mount permission)."""
    full = tmp_path / "full"
    full.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (root only)")
    yield full
    subprocess.run(["umount", str(full)], capture_output=True)


@pytest.fixture(scope="session")
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def cpu_parallel_state():
    """A single-process gloo group with Megatron parallel state (TP=PP=CP=1), CPU backend applied."""
    yield from process_group("cpu")


def process_group(device: str):
    """A fixture's body: a single-process group on `device` with Megatron parallel state (TP=PP=CP=1), destroyed
    after. Subprocesses a test starts meanwhile pick their own port (init_distributed leaves os.environ as it is)."""
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed(device, seed=1234)
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
