"""Traces of chosen training steps (`profile.*` in the recipe).

A long-context step's time goes to a few places (the attention kernel, recompute, the loss head, CP's K/V
exchange, the gradient reduce); a trace of a step or two after warm-up shows which. Two tools:

- `torch`: torch.profiler over the steps `profile.steps` = [first, last], one `step N` range each; every rank
  of `profile.ranks` writes `rank{R}.steps{first}-{last}.pt.trace.json.gz` (Chrome / Perfetto / TensorBoard's
  profiler plugin read it) and `rank{R}.steps{first}-{last}.txt`, the operators by their own time.
- `nsys`: the steps are the CUDA profiler's capture range, with one NVTX range per step, for
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop python -m megatron_ext.train ...`.

The trace runs from the start of step `first` to the end of step `last`: each step (forward, backward,
optimizer) is a `step N` range, and what runs between two traced steps (a validation, a checkpoint save) is in
the trace and the table too; the last step's validation and save come after it. A run resumed inside the range
traces the steps it still runs; one that stops inside it (a signal, divergence) writes what it traced.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_ext.recipe import ProfileConfig


class StepProfiler:
    """Starts the tool before step `first`, marks each traced step, and writes the trace after step `last`
    (`done`), or what it traced when the run ends first (`close`)."""

    def __init__(self, config: ProfileConfig, rank: int, out_dir: Path, device: str,
                 log: Callable[[str], None] = lambda msg: print(msg, flush=True)):
        self.config, self.rank, self.out_dir, self.device, self.log = config, rank, Path(out_dir), device, log
        self.enabled = config.steps is not None and rank in config.ranks
        self.first, self.last = config.steps if config.steps is not None else (0, -1)
        self._profile = None  # torch.profiler.profile while tracing
        self._traced: list[int] = []

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run training step `step` (1-based) inside this: traced when it is in the range."""
        if not self.enabled or not self.first <= step <= self.last:
            yield
            return
        if not self._traced:
            self._start()
        self._traced.append(step)
        with self._range(f"step {step}"):
            yield

    def done(self, step: int) -> None:
        """Step `step` and its bookkeeping are over: after the last traced step, write the trace (outside the
        step's time in the metrics)."""
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop tracing and write what was traced (also for a run that ends inside the range)."""
        if not self._traced:
            return
        first, last = self._traced[0], self._traced[-1]
        self._traced = []
        if self.device == "cuda":  # the traced steps' kernels end inside the trace
            torch.cuda.synchronize()
        if self.config.tool == "nsys":
            torch.cuda.cudart().cudaProfilerStop()
            self.log(f"[train] profile: steps {first}..{last} were the CUDA profiler's capture range on rank "
                     f"{self.rank}")
            return
        prof, self._profile = self._profile, None
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}.steps{first}-{last}"
        trace = self.out_dir / f"{stem}.pt.trace.json.gz"
        partial = self.out_dir / f".partial-{trace.name}"  # ends in .gz: torch compresses by the name
        prof.export_chrome_trace(str(partial))
        partial.replace(trace)
        sort = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)
        summary = self.out_dir / f"{stem}.txt"
        partial = summary.with_name(f".partial-{summary.name}")
        partial.write_text(f"steps {first}..{last}, rank {self.rank}, operators by {sort}\n{table}\n")
        partial.replace(summary)
        self.log(f"[train] profile: steps {first}..{last} on rank {self.rank}: {trace} ({summary.name}: the "
                 "costliest operators)")

    def _start(self) -> None:
        if self.device == "cuda":  # earlier steps' kernels end outside the trace
            torch.cuda.synchronize()
        if self.config.tool == "nsys":
            torch.cuda.cudart().cudaProfilerStart()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True,
                                               profile_memory=self.config.memory)
        self._profile.start()

    def _range(self, name: str):
        if self.config.tool == "nsys":
            return torch.cuda.nvtx.range(name)
        return torch.profiler.record_function(name)
