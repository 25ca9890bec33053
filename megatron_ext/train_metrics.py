"""What the training loop reports: `metrics.jsonl`, the progress lines of rank 0, peak memory, durations."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from megatron_ext import log_lines
from megatron_ext.checkpoint_index import CheckpointError
from megatron_ext.train_setup import metrics_file_problem


class MetricsLogError(CheckpointError):
    """Rank 0 could not write `metrics.jsonl` (a full disk, a quota, a file-size limit, another OSError): it lives
    in checkpoint.dir, so it is said as a checkpoint error is, once for every rank."""


class MetricsLog:
    """`metrics.jsonl`: one JSON line per step (rank 0), truncated to the resumed step on restart.

    A write that fails is not raised where it happens (rank 0 alone writes, and the other ranks would wait for it in
    the step's next collective until the process-group timeout): it is kept in `problem`, and `stop_if_unwritten`,
    which every rank calls, raises it as one MetricsLogError on every rank."""

    def __init__(self, path: Path, start_step: int, enabled: bool, tensorboard_dir: str | None = None):
        self.path = path
        self.enabled = enabled
        self.problem: str | None = None  # rank 0's one line about a write that failed; nothing is written after it
        self.tensorboard, self.tensorboard_dir = None, tensorboard_dir
        if enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_writer_thread()
            try:
                # purge_step: TensorBoard hides the events a killed run wrote after the step this one resumes at
                self.tensorboard = SummaryWriter(tensorboard_dir, purge_step=start_step + 1)
            except OSError as e:
                self._tensorboard_off(e, start_step + 1)
        if enabled:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                self.problem = self._unwritten(e, "training did not start")
                return
            # said before the first step: a folder or a file of other bytes there, or a link into no folder
            self.problem = metrics_file_problem(path, read=False)
            if self.problem is not None:
                return
        if enabled and path.exists():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                self.problem = metrics_file_problem(path) or f"metrics log {path}: cannot be read ({e})"
                return
            kept, broken, redone = [], [], []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    # A run killed mid-write (kill -9, full disk) leaves a partial last line; it must not stop
                    # every resume. The steps after the checkpoint are written again anyway.
                    broken.append(number)
                    continue
                if not isinstance(step, int) or isinstance(step, bool):  # {"step": null}: no line the trainer wrote
                    broken.append(number)
                    continue
                if step <= start_step:
                    kept.append(line)
                else:
                    redone.append(step)
            if broken:
                log(f"[train] warning: {path}: dropped {len(broken)} unreadable line(s) (line "
                    f"{', '.join(map(str, broken[:5]))}{', ...' if len(broken) > 5 else ''}; a run killed while "
                    "writing leaves one)")
            if redone:  # a run stopped without saving (kill -9, node failure): the steps after the checkpoint
                log(f"[train] {path}: dropped the lines of steps {min(redone)}..{max(redone)}, written after the "
                    f"checkpoint of step {start_step}: those steps run again")
            tmp = path.with_suffix(".jsonl.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)
            except OSError as e:  # the log as it was stays; the unfinished copy goes (its space back)
                tmp.unlink(missing_ok=True)
                self.problem = self._unwritten(e, f"rewriting it to the {len(kept)} line(s) up to step {start_step} "
                                                  "failed (it is as it was); training did not start")

    def write(self, record: dict) -> None:
        """Append `record` as one line (rank 0); after a failed write (`problem`), nothing more."""
        if self.problem is not None:
            return
        if self.enabled:
            line = (json.dumps(strict_json_record(record), allow_nan=False) + "\n").encode()
            try:
                append_whole(self.path, line)
            except OSError as e:
                self.problem = self._unwritten(e, f"training stopped after step {record['step']}, whose line is not "
                                                  "there")
                return
        if self.tensorboard is not None:
            try:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.tensorboard.add_scalar(tensorboard_tag(key), value, record["step"])
                self.tensorboard.flush()  # a step takes seconds at scale; a killed run keeps every step written
            except OSError as e:
                self._tensorboard_off(e, record["step"])

    def _tensorboard_off(self, error: OSError, step: int) -> None:
        """A TensorBoard write failed: one warning, no events from `step` on, and training goes on. Unlike a line of
        metrics.jsonl (`stop_if_unwritten`), the events hold only numbers metrics.jsonl has too, and where they share
        checkpoint.dir's disk, metrics.jsonl's next line stops the run anyway."""
        from megatron_ext.disk_space import no_space_message

        writer, self.tensorboard = self.tensorboard, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass  # what it still held is lost with the rest
        where, folder = f"checkpoint.tensorboard_dir {self.tensorboard_dir}", self.tensorboard_dir
        outcome = f"no TensorBoard events from step {step} on (metrics.jsonl has every step)"
        said = (no_space_message(error, where, folder, outcome, "free space there")
                or f"{where}: cannot be written ({error.strerror or error}); {outcome}")
        log(f"[train] warning: {said}")

    def stop_if_unwritten(self) -> None:
        """Raise MetricsLogError on every rank, alike (said once), when rank 0's write failed; collective: every rank
        calls it after each `write` (one integer all-reduced).

        The run stops rather than going on without its metrics, as a checkpoint save without room stops it:
        metrics.jsonl is in checkpoint.dir, beside the checkpoints, so a disk or quota without room for a line of
        300 bytes has none for the next checkpoint (gigabytes) either, and every step trained until that save would
        be lost with it. Stopping now loses only the steps since the newest checkpoint, which that save's failure
        would lose too; and a log with steps missing is a loss curve with a hole nobody asked for."""
        failed = self.problem is not None
        if not torch.distributed.is_initialized():
            if failed:
                raise MetricsLogError(self.problem)
            return
        from megatron_ext.runtime.distributed import alike_on_every_rank, rank_device, rank_zero_outcome

        flag = torch.tensor([int(failed)], dtype=torch.int32, device=rank_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            said = rank_zero_outcome(lambda: self.problem, MetricsLogError)[0]
            raise alike_on_every_rank(MetricsLogError(said or f"metrics log {self.path}: a write failed on a rank "
                                                                "other than 0"))

    def _unwritten(self, error: OSError, outcome: str) -> str:
        """The one line for a failed write of the log: the space left where it is, what became of the run and the
        newest checkpoint, and the fix."""
        from megatron_ext.checkpoint_layout import latest_iteration
        from megatron_ext.disk_space import no_space_message

        root = self.path.parent
        try:
            latest = latest_iteration(root)
        except (CheckpointError, OSError):
            latest = None
        outcome += ("; there is no checkpoint yet" if latest is None else
                    f"; the latest checkpoint is iteration {latest}, where the same command goes on from")
        said = no_space_message(error, f"metrics log {self.path}", root, outcome,
                                "free space there (checkpoints are saved there too) or set checkpoint.dir elsewhere")
        return said or (f"metrics log {self.path}: cannot be written ({error.strerror or error}); {outcome}; check "
                        "the file system of checkpoint.dir")


def _quiet_tensorboard_writer_thread() -> None:
    """Keep Python from printing a traceback when TensorBoard's writer thread fails to write (an OSError): the
    thread hands the error on to the next add_scalar or flush, where `MetricsLog` says it in one warning."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path`, or nothing: a write cut short (a full disk, a file-size limit) is cut off again, so
    that the file still ends in a whole line for the tools that read it (jq, a resume)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            try:
                os.ftruncate(fd, size)  # needs no room
            except OSError:
                pass  # the partial line stays; a resume drops it (MetricsLog warns)
            raise
    finally:
        os.close(fd)


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl field: `val_loss` -> `val/loss`, `loss` -> `train/loss`."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def strict_json_record(record: dict) -> dict:
    """`record` with NaN/Inf numbers (a diverged step) as null, named in `non_finite` ({"loss": "nan"}):
    Python's json writes them as the bare words NaN and Infinity, which jq, JavaScript and most JSON readers
    refuse, so one diverged step made the whole file unreadable to them."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "non_finite": bad}


def memory_gib() -> float:
    """Peak GPU memory allocated by a process, or its resident memory on the CPU (GiB): the largest over the ranks
    (a collective when a process group exists), since the rank holding the most runs out first: under PP the
    first stage keeps more activations in flight, the last one the loss head."""
    if torch.cuda.is_available():
        gib = torch.cuda.max_memory_allocated() / 2**30
    else:
        import psutil

        gib = psutil.Process().memory_info().rss / 2**30
    if not torch.distributed.is_initialized():
        return gib
    from megatron_ext.runtime.distributed import rank_device

    largest = torch.tensor([gib], dtype=torch.float64, device=rank_device())
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return largest.item()


class LogWindow:
    """The steps since the last progress line: their loss as one token mean (as Megatron-LM averages its loss over
    the log interval), their tokens and FLOPs per second of step time."""

    def __init__(self) -> None:
        self.loss_sum = self.loss_tokens = self.tokens = self.seconds = self.tflop_s = 0.0

    def add(self, record: dict) -> None:
        self.loss_sum += record["loss"] * record["loss_tokens"]
        self.loss_tokens += record["loss_tokens"]
        self.tokens += record["tokens_per_s"] * record["step_time_s"]
        self.tflop_s += record["tflops_per_device"] * record["step_time_s"]
        self.seconds += record["step_time_s"]

    def take(self) -> dict:
        """Loss, tokens/s and TFLOP/s per device over the window; the window starts again."""
        seconds = max(self.seconds, 1e-9)
        mean = {"loss": self.loss_sum / max(self.loss_tokens, 1), "tokens_per_s": self.tokens / seconds,
                "tflops_per_device": self.tflop_s / seconds}
        self.__init__()
        return mean


def log(msg: str, every_rank: bool = False) -> None:
    """Print `msg` after the local wall-clock time (`[2026-12-02 14:05:09] [train] step 3/10 ...`), on rank 0 only
    (every rank when there is no process group), or on every rank that calls it with `every_rank`."""
    if every_rank or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        # A job log spans days and requeues: the time lets its lines be read against Slurm's and the nodes' events
        # (log_lines says why and how, for the evaluation tools' lines too).
        log_lines.log_line(msg)


def format_duration(seconds: float) -> str:
    """`45s`, `12m05s`, `3h07m` (hours and minutes from an hour on)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
