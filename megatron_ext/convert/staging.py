"""Output staging (temp folder renamed into place on success), peak memory, process group setup."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
from pathlib import Path
from typing import Iterator

from megatron_ext.convert.hf_io import ConvertError


@contextlib.contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` only if the block succeeds.

    An existing `out` is an error unless `force`, and is replaced only after the new one is complete.
    """
    out = Path(out).absolute()
    if out.exists() and not force:
        raise ConvertError(f"--out {out} already exists; choose another path or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process and of its finished children (checkpoint writer helpers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024  # Linux reports KiB


def ensure_cpu_process_group() -> None:
    """A single-process gloo group and Megatron parallel state (TP=PP=1) unless one is already set up."""
    import torch
    from megatron.core import parallel_state

    from megatron_ext.runtime import init_distributed

    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_tensor_model_parallel_world_size() == 1 \
            and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != 1:
        raise ConvertError("the converter runs in one process; do not start it under torchrun")
    init_distributed("cpu")
