"""The run metadata a save writes beside the torch_dist files (`megatron_ext.json`, megatron_ext.checkpoint):
what the caller gave (HF config, recipe, tokenizer) plus where the checkpoint came from (format, time,
parallel layout, package versions, git commit of this source tree).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import subprocess
from pathlib import Path
from typing import Any

import torch

FORMAT = "megatron_ext/1"


def _versions() -> dict[str, str | None]:
    out = {}
    for pkg in ("megatron-ext", "megatron-core", "torch", "transformers", "safetensors"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_sha() -> str | None:
    """Commit of the megatron_ext source tree (with `-dirty` for local changes), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _parallel_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"tensor": 1, "pipeline": 1, "context": 1, "data": 1}
    return {"tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "context": ps.get_context_parallel_world_size(),
            "data": ps.get_data_parallel_world_size()}


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (Path, torch.dtype)):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"metadata value of type {type(obj).__name__} is not JSON-serialisable")


def run_metadata_text(iteration: int, metadata: dict) -> str:
    """The metadata file's text for a save of `iteration`: our provenance fields, then `metadata` (which wins)."""
    info = {
        "format": FORMAT,
        "iteration": iteration,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parallel": _parallel_layout(),
        "versions": _versions(),
        "git_sha": _git_sha(),
        **metadata,
    }
    return json.dumps(info, indent=2, default=_json_default) + "\n"
