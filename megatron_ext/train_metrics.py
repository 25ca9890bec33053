"""What the training loop reports: `metrics.jsonl`, the progress lines of rank 0, peak memory, durations."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from megatron_ext import log_lines


class MetricsLog:
    """`metrics.jsonl`: one JSON line per step (rank 0), truncated to the resumed step on restart."""

    def __init__(self, path: Path, start_step: int, enabled: bool, tensorboard_dir: str | None = None):
        self.path = path
        self.enabled = enabled
        self.tensorboard = None
        if enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events a killed run wrote after the step this one resumes at
            self.tensorboard = SummaryWriter(tensorboard_dir, purge_step=start_step + 1)
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
        if enabled and path.exists():
            kept, broken, redone = [], [], []
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    # A run killed mid-write (kill -9, full disk) leaves a partial last line; it must not stop
                    # every resume. The steps after the checkpoint are written again anyway.
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
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(strict_json_record(record), allow_nan=False) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(tensorboard_tag(key), value, record["step"])
            self.tensorboard.flush()  # a step takes seconds at scale; a killed run keeps every step written


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
