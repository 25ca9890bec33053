"""The local Slurm cluster for these tests (tests/slurm/local_cluster.sh) and job helpers.

`tests/run.sh` starts the cluster in the background when the suite starts and exports
MEGATRON_EXT_SLURM_STATUS, a file that receives the start script's exit code and output. Without
it (plain `pytest tests/slurm`) the fixture starts the cluster itself. Tests skip only when the
script says Slurm cannot run here (exit 2: not root, no apt); any other failure fails them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

START = ROOT / "tests/slurm/local_cluster.sh"
# The tiny CPT recipe at a size that runs in seconds; the same overrides go to torchrun and sbatch.
TINY = ROOT / "recipes/tiny/cpt.yaml"
TINY_OVERRIDES = ["train.seq_length=256", "train.global_batch_size=1", "train.lr=1e-2", "runtime.device=cpu"]
NODES, TASKS_PER_NODE = 2, 1  # 2 "nodes" x 1 task: CP=2 across nodes (the host has 2 cores)
SBATCH_SIZE = [f"--nodes={NODES}", f"--ntasks-per-node={TASKS_PER_NODE}", "--gpus-per-node=0",
               "--cpus-per-task=1", "--time=30"]


def _start_status() -> tuple[int, str]:
    status_file = os.environ.get("MEGATRON_EXT_SLURM_STATUS")
    if status_file:
        path = Path(status_file)
        deadline = time.time() + 600
        while not (path.exists() and path.read_text().strip()):
            if time.time() > deadline:
                return 1, f"local cluster start did not finish in 600 s ({path})"
            time.sleep(0.5)
        code, _, output = path.read_text().partition("\n")
        return int(code), output
    proc = subprocess.run(["bash", str(START), "start"], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def slurm_cluster():
    code, output = _start_status()
    if code == 2:
        reason = [line for line in output.splitlines() if "cannot run Slurm" in line] or [output.strip()]
        pytest.skip(f"no local Slurm cluster: {reason[-1]}")
    if code != 0:
        pytest.fail(f"local Slurm cluster failed to start (exit {code}):\n{output[-3000:]}")
    return output


@contextlib.contextmanager
def cluster_busy():
    """Every node taken by one exclusive job, so that a job submitted meanwhile stays PENDING (reason Resources).

    Slurm 22.05's sbatch ignores SBATCH_HOLD (only -H/--hold holds a job): a job meant to wait unseen ran when the
    scheduler got to it first, within ~40 ms of its submission."""
    nodes = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, check=True).stdout.split()
    job = subprocess.run(["sbatch", "--parsable", f"--nodes={sum(map(int, nodes))}", "--exclusive", "--time=10",
                          "--output=/dev/null", "--wrap", "sleep 600"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        deadline = time.time() + 60
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                             text=True).stdout.strip() != "RUNNING":
            assert time.time() < deadline, f"job {job} holding the whole cluster did not start in 60 s"
            time.sleep(0.2)
        yield job
    finally:
        subprocess.run(["scancel", job], check=False)


def job_env(**extra: str) -> dict:
    """The submitter's environment for jobs (sbatch exports it): this venv's python, 1 thread."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    env.pop("RECIPE", None)
    env.update(extra)
    return env


def sbatch(script: str, *args: str, env: dict | None = None, out: Path) -> subprocess.CompletedProcess:
    """`sbatch --wait SIZE --output=out slurm/SCRIPT args` from the project root."""
    cmd = ["sbatch", "--parsable", "--wait", *SBATCH_SIZE, f"--output={out}", str(ROOT / "slurm" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env or job_env(), timeout=600)


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def wait_job(job_id: str, timeout: float = 400) -> tuple[str, str]:
    """Poll accounting until the job reaches a final state; returns (State, ExitCode).

    Used instead of `sbatch --wait` across a requeue: sbatch --wait can return (exit 1) while the
    job is between its runs.
    """
    deadline = time.time() + timeout
    settled_since = None
    while time.time() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        row = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode"],
                             capture_output=True, text=True).stdout.strip().split("|")
        state = row[0].split()[0] if row and row[0] else ""
        if not queued.stdout.strip() and state in FINAL_STATES:
            # A requeueing job shows a final state for a moment before it is pending again:
            # only a state that holds for 5 s is the job's end.
            settled_since = settled_since or time.time()
            if time.time() - settled_since >= 5:
                return state, row[1]
        else:
            settled_since = None
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not finished after {timeout} s")


class RequeueNow:
    """Background loop that lets requeued jobs start at once.

    Slurm holds a requeued job for 121 s (`PENDING BeginTime`); setting its StartTime to now once
    it is in that state starts it within a second (measured on this test cluster). Test-only: production jobs
    simply wait.
    """

    def __init__(self):
        self._stop = threading.Event()
        self.released: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        pending_since: dict[str, float] = {}
        while not self._stop.is_set():
            out = subprocess.run(["squeue", "-h", "-t", "PENDING", "-o", "%i %r"], capture_output=True,
                                 text=True).stdout
            for line in out.splitlines():
                job, _, reason = line.partition(" ")
                if reason.strip() != "BeginTime":
                    continue
                # Released within a second of the requeue, slurmd may still hold the revoked
                # credential of the previous run and kills the new one ("Job credential revoked").
                first = pending_since.setdefault(job, time.time())
                if time.time() - first >= 5:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                                   capture_output=True)
                    self.released.append(job)
                    pending_since.pop(job)
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
