"""Re-save a training checkpoint's distributed-optimizer state `fully_reshardable` (`tools/checkpoint.py reshard`).

A `dp_reshardable` state (the default of `checkpoint.optimizer_sharding`, as of Megatron-LM) holds each TP x PP
rank's flat gradient buckets: a run at another TP, PP or bucket size cannot read it and starts a fresh optimizer
state. This loads the checkpoint at the TP x PP it was saved at, CP 1 and DP = the processes / (TP x PP) (a
dp_reshardable state loads at any DP x CP; more processes hold less of it each), with the model and optimizer the
saved recipe builds, and saves the same iteration into another folder with the state gathered into the parameters'
shapes, which any layout resumes. The weights, the scheduler, the run's metadata (recipe, position in the data,
data identity) and its metrics.jsonl go along; the run resumes from the new folder as from the old.

The new folder is written as `.NAME.partial` beside it and renamed into place when complete (`staging_folder`): an
interrupt or a failure removes it, and a killed run's is removed by the next, so that `--out` is a whole checkpoint
or not there.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from megatron_ext.checkpoint_layout import checked_metadata, resolve_iteration_dir
from megatron_ext.checkpoint_index import CheckpointError, saved_bucket_size, saved_fully_reshardable
from megatron_ext.cli_types import WRITE_PROBE_PREFIX, folder_write_problem

# written by every save itself (megatron_ext.checkpoint): not carried over from the source
_OWN_KEYS = ("format", "iteration", "created", "parallel", "versions", "git_sha", "model_chunks", "has_optimizer",
             "optimizer_sharding")


def reshard_plan(src: str | Path, out: str | Path, iteration: int | None, world_size: int) -> tuple[Path, dict, list]:
    """(the source `iter_*` folder, its metadata, the recipe overrides of the conversion run), or a CheckpointError
    naming what stops it. Needs no process group."""
    _, path = resolve_iteration_dir(src, iteration)
    saved = checked_metadata(path)
    out = Path(out)
    train = (saved.get("recipe") or {}).get("train")
    if not train or not saved.get("parallel"):
        raise CheckpointError(f"{path} records no training recipe and layout: only checkpoints that "
                              "megatron_ext.train saved hold an optimizer state to reshard")
    if saved.get("has_optimizer") is False:
        raise CheckpointError(f"{path} holds no optimizer state (converted or weights-only): nothing to reshard")
    if not train.get("distributed_optimizer"):
        raise CheckpointError(f"{path}: train.distributed_optimizer was false: the plain optimizer's state already "
                              "loads at any layout; nothing to reshard")
    if saved_fully_reshardable(saved):
        raise CheckpointError(f"{path} is already saved fully_reshardable: any layout resumes it; nothing to do")
    tp, pp = saved["parallel"]["tensor"], saved["parallel"]["pipeline"]
    if world_size % (tp * pp):
        raise CheckpointError(
            f"{path} was saved at TP {tp} x PP {pp}: reshard it on a multiple of TP x PP = {tp * pp} processes (got "
            f"{world_size}), e.g. `torchrun --nproc_per_node={tp * pp} tools/checkpoint.py reshard {src} --out {out}` "
            f"on a node of the kind it was trained on "
            f"({((saved.get('recipe') or {}).get('runtime') or {}).get('device', '?')})")
    root = path.parent
    if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents:
        raise CheckpointError(f"--out {out} is, or lies inside, the checkpoint folder {root}: pick a new folder")
    there = out.absolute()
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        where = "is a file" if there == out.absolute() else f"lies under {there}, which is a file"
        raise CheckpointError(f"--out {out} {where}, not a folder: give a new folder path")
    left = sorted(p.name for p in out.iterdir() if not p.name.startswith(WRITE_PROBE_PREFIX)) if out.exists() else []
    if left:  # (another rank's probe below is no content: every rank runs this check at once)
        if all(name.endswith(".partial") for name in left):
            raise CheckpointError(f"--out {out} holds only the unfinished save of an interrupted run ({', '.join(left)})"
                                  f": remove {out} and run again")
        raise CheckpointError(f"--out {out} exists and is not empty: pick a new folder (a resharded checkpoint is "
                              "a new checkpoint.dir to resume from)")
    problem = folder_write_problem(out)  # now, not after the load: there the save failed as a traceback per rank
    if problem:
        raise CheckpointError(f"--out {out}: {problem}")
    overrides = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", "parallel.context=1",
                 "parallel.cp_comm_type=p2p", "parallel.hierarchical_context_sizes=null",
                 f"train.global_batch_size={world_size // (tp * pp)}", "train.micro_batch_size=1",
                 f"checkpoint.dir={out}", "checkpoint.optimizer_sharding=fully_reshardable",
                 "checkpoint.async_save=false"]
    if ((saved.get("recipe") or {}).get("model") or {}).get("hf_config"):
        # the saved recipe holds the architecture it read from that file: the file may be gone (another machine)
        overrides.append("model.hf_config=null")
    if train.get("overlap_grad_reduce"):
        # the saved buckets, whose default size depends on the DP of the run that saved them
        overrides.append(f"train.ddp_bucket_size={saved_bucket_size(saved)}")
    return path, saved, overrides


def staging_folder(out: str | Path) -> Path:
    """Where `reshard` writes the new checkpoint.dir before it is complete: beside `out`, so that the rename is on
    one file system; the same on every rank (they all write into it)."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def reshard(src: str | Path, out: str | Path, iteration: int | None = None) -> Path:
    """Load `src` (a checkpoint.dir, its latest iteration, or one `iter_*` folder) at its own TP x PP and save it
    into `out` with the optimizer state `fully_reshardable`; returns the new `iter_*` folder. Collective: run on
    a multiple of TP x PP processes (torchrun), on the device the run trained on. Any exception, KeyboardInterrupt
    too, leaves no `out` (made, whole, at the end) and no staging folder."""
    from megatron_ext.checkpoint import load_checkpoint, save_checkpoint
    from megatron_ext.model import build_model_from_recipe
    from megatron_ext.recipe import load_recipe
    from megatron_ext.runtime import destroy_distributed, init_distributed, process_env
    from megatron_ext.runtime.distributed import rank_zero_outcome
    from megatron_ext.train import build_optimizer, wrap_ddp
    from megatron_ext.train_metrics import log

    world, rank0 = process_env().world_size, process_env().rank == 0
    path, saved, overrides = reshard_plan(src, out, iteration, world)
    recipe = load_recipe(raw=saved["recipe"], overrides=overrides, world_size=world)
    p = recipe.parallel
    out, stage = Path(out), staging_folder(out)
    if rank0:  # a killed reshard's; the others wait for rank 0 in init_distributed before they write
        shutil.rmtree(stage, ignore_errors=True)
    init_distributed(recipe.runtime.device, tensor=p.tensor, pipeline=p.pipeline, seed=recipe.train.seed,
                     timeout_minutes=recipe.runtime.timeout_minutes)
    try:
        model = build_model_from_recipe(recipe)
        ddp_model = wrap_ddp(recipe, model)
        optimizer, scheduler = build_optimizer(recipe, [ddp_model])
        log(f"[reshard] loading {path} at TP {p.tensor} x PP {p.pipeline} x DP {world // (p.tensor * p.pipeline)}")
        began = time.time()
        step, extra = load_checkpoint(path, [model], optimizer=optimizer, scheduler=scheduler)
        log(f"[reshard] loaded ({time.time() - began:.1f} s); saving it fully_reshardable into {out}")
        metadata = {k: v for k, v in saved.items() if k not in _OWN_KEYS}
        metadata["resharded_from"] = {"path": str(path), "parallel": saved["parallel"]}
        final = save_checkpoint(stage, step, [model], optimizer=optimizer, scheduler=scheduler, metadata=metadata,
                                extra=extra, optimizer_sharding="fully_reshardable")
        metrics = path.parent / "metrics.jsonl"

        def publish() -> None:
            if metrics.is_file():  # the run's curve goes on in the new folder
                shutil.copyfile(metrics, stage / "metrics.jsonl")
            os.replace(stage, out)  # onto nothing, or the empty folder reshard_plan accepted

        # rank 0's outcome on every rank: none says it is done before the folder is in place, none waits on a failure
        _, problem = rank_zero_outcome(publish, OSError)
        if problem is not None:
            raise CheckpointError(f"--out {out}: the resharded checkpoint could not be put in place ({problem}); "
                                  "nothing was left there or beside it")
        return out / final.name
    except BaseException:
        if rank0:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        destroy_distributed()
