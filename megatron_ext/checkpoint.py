"""TEMPORARY checkpoint module for the lead's loop testing (replaced by the converter branch)."""
from __future__ import annotations
import json, os
from pathlib import Path
import torch

class CheckpointError(ValueError):
    pass

def _md(optimizer):
    from megatron.core import parallel_state
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
          "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if optimizer is not None and getattr(optimizer.config, "use_distributed_optimizer", False):
        md["distrib_optim_sharding_type"] = "dp_reshardable"
    return md

def latest_iteration(root):
    f = Path(root) / "latest_checkpointed_iteration.txt"
    return int(f.read_text().strip()) if f.is_file() else None

def _state(model_chunks, optimizer, scheduler, md, is_loading=False):
    msd = model_chunks[0].sharded_state_dict(metadata=md)
    sd = {"model": msd}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(msd, is_loading=is_loading, metadata=md)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    return sd

def save_checkpoint(root, iteration, model_chunks, *, optimizer=None, scheduler=None, metadata=None, extra=None, keep_last=None):
    from megatron.core import dist_checkpointing
    root = Path(root); d = root / f"iter_{iteration:07d}"
    rank0 = torch.distributed.get_rank() == 0
    if rank0: d.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    md = _md(optimizer)
    sd = _state(model_chunks, optimizer, scheduler, md)
    sd["extra"] = extra or {}
    dist_checkpointing.save(sd, str(d), content_metadata={k: v for k, v in md.items() if k != "dp_cp_group"})
    torch.distributed.barrier()
    if rank0:
        (d / "run_metadata.json").write_text(json.dumps(metadata or {}))
        tmp = root / "latest_checkpointed_iteration.txt.tmp"; tmp.write_text(str(iteration)); os.replace(tmp, root / "latest_checkpointed_iteration.txt")
    torch.distributed.barrier()

def _ensure_optimizer_state(optimizer):
    # Without Apex/TE, Megatron's optimizer falls back to torch AdamW, whose state is created lazily at
    # the first step; DistributedOptimizer.state_dict() asserts a `step` exists. Loading into a fresh
    # optimizer therefore needs placeholder state that the load then overwrites in place.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _restore_adam_step(optimizer):
    # torch AdamW keeps `step` per parameter; Megatron's DistributedOptimizer saves it once in the
    # param groups but its dp_reshardable loader then copies the per-parameter placeholder over it.
    # Restore it from the param groups, where the saved value survives.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def load_checkpoint(root, model_chunks, *, optimizer=None, scheduler=None, iteration=None, weights_only=False):
    from megatron.core import dist_checkpointing
    root = Path(root)
    it = iteration if iteration is not None else latest_iteration(root)
    d = root / f"iter_{it:07d}"
    md = _md(optimizer)
    if optimizer is not None and not weights_only:
        _ensure_optimizer_state(optimizer)
    sd = _state(model_chunks, None if weights_only else optimizer, None, md, is_loading=True)
    loaded = dist_checkpointing.load(sd, str(d))
    model_chunks[0].load_state_dict(loaded["model"])
    if optimizer is not None and not weights_only:
        with torch.no_grad():  # copies into fp32 main params, which are leaves requiring grad
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(dist_checkpointing.load_common_state_dict(str(d))["scheduler"])
    return it, {}
