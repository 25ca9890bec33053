"""What a Slurm job checks about other jobs and about itself before it trains or requeues: whether another job
is writing the same `checkpoint.dir`, and whether it may requeue itself once more (`MAX_REQUEUES`). Used by
`python -m megatron_ext.launch --check` (the sbatch scripts' preflight) and by the submitit stages, which also end
as a requeue once submitit has requeued them (`requeue_ends_the_task`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from megatron_ext.recipe import RecipeError

# The Slurm job that writes a checkpoint.dir, one line: its id. Beside the checkpoints, not in them.
OWNER_FILE = ".slurm_job"
DEFAULT_MAX_REQUEUES = 50  # slurm/common.sh's default too
_ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
          "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED")


UNKNOWN = "UNKNOWN"  # job_state's answer when squeue cannot be asked: not taken for an ended job
# `launch --check --claim --host-squeue` (slurm/common.sh's preflight in a container, where squeue is usually missing)
# exits with EXIT_ASK_HOST after a last stdout line `OWNER_UNKNOWN_LINE ID` where it cannot learn the state of the job
# ID that holds checkpoint.dir; the batch shell asks squeue itself and runs the check again with
# `--owner-state ID=STATE`.
EXIT_ASK_HOST = 5
OWNER_UNKNOWN_LINE = "claim-owner-unknown:"


class OwnerStateUnknown(RecipeError):
    """The claim is refused only because whether job `owner`, which holds the folder, still runs is unknown here."""

    def __init__(self, message: str, owner: str):
        super().__init__(message)
        self.owner = owner


def parse_owner_state(text: str) -> tuple[str, str]:
    """`ID=STATE` (`--owner-state`, what squeue on the batch host says of job ID; an empty STATE: Slurm no longer
    lists it) -> (ID, STATE). ValueError unless ID is a job number."""
    job, sep, state = text.partition("=")
    if not sep or not job.isdigit():
        raise ValueError(f"{text!r}: give JOBID=STATE, e.g. 1234=COMPLETED (1234= where squeue no longer lists it)")
    return job, state.strip()


def job_state(job_id: str) -> str | None:
    """The state squeue shows for `job_id` (`RUNNING`, `PENDING`, ...), None when Slurm no longer lists it, or
    `UNKNOWN (why)` when squeue cannot be asked (not installed, as in many containers; timed out; failed)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        return f"{UNKNOWN} (squeue: {e.strerror or e})"
    except subprocess.TimeoutExpired:
        return f"{UNKNOWN} (squeue did not answer in 60 s)"
    if proc.returncode != 0:  # a job Slurm has forgotten: "Invalid job id specified"
        why = " ".join(proc.stderr.split())
        return None if "invalid job id" in why.lower() else f"{UNKNOWN} (squeue: {why or f'exit {proc.returncode}'})"
    return proc.stdout.strip().split("\n")[0].strip() or None


def claim_checkpoint_dir(checkpoint_dir: str, job_id: str,
                         state_of: Callable[[str], str | None] | None = None, write: bool = True) -> None:
    """Record Slurm job `job_id` as the writer of `checkpoint_dir` (in its `.slurm_job`), or raise RecipeError
    when another job that is still queued or running holds it. `write=False` only checks: the other tasks of a
    job, whose rank 0 records it (each task stops by itself, none waits for a rank that has stopped).

    Two jobs of the same run (the same stage submitted twice) would save into one folder at once: each
    overwrites the other's iterations and `latest` pointer, the metrics file gets both runs' lines, and one of
    them dies mid-save. A requeued run is the same job id and keeps its claim; a job that has ended leaves a
    claim the next one takes over.
    """
    root = Path(checkpoint_dir)
    path = root / OWNER_FILE
    if not write:
        owner = path.read_text().strip() if path.is_file() else ""
        if owner and owner != job_id:
            _refuse_if_live(checkpoint_dir, owner, state_of)
        return
    root.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: of two jobs starting at once, one creates the file and the other reads its id
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner = path.read_text().strip()
        if owner and owner != job_id:
            _refuse_if_live(checkpoint_dir, owner, state_of)
        if owner != job_id:
            tmp = root / f"{OWNER_FILE}.{job_id}.{os.getpid()}"
            tmp.write_text(f"{job_id}\n")
            os.replace(tmp, path)
        return
    with os.fdopen(fd, "w") as f:
        f.write(f"{job_id}\n")


def _refuse_if_live(checkpoint_dir: str, owner: str, state_of: Callable[[str], str | None] | None) -> None:
    """RecipeError when job `owner`, which holds `checkpoint_dir`, is still queued or running."""
    state = (state_of or job_state)(owner)
    if state is not None and state.startswith(UNKNOWN):
        raise OwnerStateUnknown(
            f"checkpoint.dir = {checkpoint_dir!r} is held by Slurm job {owner}, and whether it still runs is "
            f"{state}: two runs in one folder overwrite each other's checkpoints. If job {owner} has ended, delete "
            f"{Path(checkpoint_dir) / OWNER_FILE}; else wait for it, cancel it, or give this run another checkpoint.dir",
            owner)
    if state is not None and state.split()[0] not in _ENDED:
        raise RecipeError(
            f"checkpoint.dir = {checkpoint_dir!r} is being written by Slurm job {owner} ({state}); two runs "
            f"in one folder overwrite each other's checkpoints. Wait for it, cancel it (scancel {owner}), "
            "or give this run another checkpoint.dir")


def requeue_refusal(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this job must not requeue itself again (`MAX_REQUEUES`, default 50, against SLURM_RESTART_COUNT), or
    None when it may. The bound keeps a job that can never finish from requeueing forever."""
    env = os.environ if environ is None else environ
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    text = env.get("MAX_REQUEUES", "") or str(DEFAULT_MAX_REQUEUES)
    if not text.isdigit():
        return f"MAX_REQUEUES = {text!r} is not a whole number; export MAX_REQUEUES=50 (or another bound)"
    if restarts >= int(text):
        return f"not requeueing: {restarts} restarts (MAX_REQUEUES = {text}); resubmit to go on from the checkpoint"
    return None


def check_warning_fits(time_text: str, minutes: int, delay_s: int) -> None:
    """RecipeError when the time limit (`time_text`, `minutes` long) is not longer than the USR1 warning sent
    `delay_s` seconds before it: every run would be warned while it starts, save at once (or not at all) and
    requeue, over and over, with next to no training in between."""
    if delay_s < 0:
        raise RecipeError(f"--signal-delay-s {delay_s}: give the seconds before the time limit, e.g. 600")
    if minutes * 60 <= delay_s:
        raise RecipeError(f"--time {time_text}: not longer than the USR1 warning --signal-delay-s {delay_s} s before "
                          "it, so each job would be told to stop as it starts and requeue in a loop; give a longer "
                          "--time or a smaller --signal-delay-s")


@contextlib.contextmanager
def requeue_ends_the_task(signum: int = signal.SIGUSR1) -> Iterator[None]:
    """Within the block, once the handler of `signum` (submitit's) has requeued the job, the task leaves as that
    requeue, `SystemExit(-1)`, whatever the signal interrupted turned it into.

    submitit's handler checkpoints the callable on rank 0, runs `scontrol requeue` and raises SystemExit(-1) from the
    signal handler, in whatever the main thread was doing. When that is the initialisation of a C extension (a module
    imported on first use: matplotlib's Agg renderer when a NIAH heatmap is first drawn) CPython turns it into
    `ImportError: initialization failed`; submitit, which catches exceptions, writes that as the job's result, and
    `launch --wait` reported the requeued job failed and cancelled the stages after it (seen in tests/slurm). A
    handler that returns (other ranks) or raises anything else (submitit's "not requeued") changes nothing. Off the
    main thread, or with no Python handler installed, the block does nothing.
    """
    handler = signal.getsignal(signum)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    requeued = []

    def noted(number: int, frame) -> None:
        try:
            handler(number, frame)
        except SystemExit:
            requeued.append(number)
            raise

    signal.signal(signum, noted)
    try:
        yield
    except BaseException:
        if requeued:
            raise SystemExit(-1) from None
        raise
    finally:
        if signal.getsignal(signum) is noted:
            signal.signal(signum, handler)
    if requeued:  # the program swallowed the exit: Slurm has requeued the job all the same
        raise SystemExit(-1)
