"""Distributed checkpoints: Megatron-Core `dist_checkpointing` (torch_dist) in Megatron-LM's layout.

    ROOT/iter_0000010/                 torch_dist files (+ common.pt, metadata.json) and
    ROOT/iter_0000010/megatron_ext.json  our run metadata (HF config incl. rope, recipe, versions, git SHA;
                                         written by checkpoint_run_metadata.py)
    ROOT/latest_checkpointed_iteration.txt

Checkpoints are global (every tensor stored with its full shape), so the weights of a checkpoint saved at any
TP/PP load at any other TP/PP (the default dp_reshardable optimizer state does not: checkpoint_reshard.py), and `megatron.core.dist_checkpointing.load_plain_tensors` reads
it without a model. An iteration directory appears only when complete: it is written under a
temporary name and renamed by rank 0; the latest pointer is replaced atomically afterwards.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.checkpoint_damage import read_failure_error
from megatron_ext.checkpoint_index import METADATA_FILE, CheckpointError, check_complete, check_fits, read_dcp_index
from megatron_ext.checkpoint_layout import (LATEST_FILE, available_iterations, complete_soon, iter_dir_name,
                                            resolve_iteration_dir)
from megatron_ext.checkpoint_optimizer import fit_loaded_optimizer_state, materialise_optimizer_state
from megatron_ext.checkpoint_run_metadata import run_metadata_text
from megatron_ext.checkpoint_space import CheckpointSpaceError, local_bytes, space_checked, space_verdict
from megatron_ext.runtime.distributed import alike_on_every_rank, rank_zero_outcome
from megatron_ext.runtime.signals import children_killed_on_interrupt, interrupts_unwrapped


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(p, DistributedOptimizer) for p in parts)


def _sharding_metadata(optimizer, saved: dict | None = None, optimizer_sharding: str = "dp_reshardable") -> dict:
    """The `metadata` argument of `sharded_state_dict` (Megatron-Core's sharding options: the optimizer's format)."""
    from megatron.core import parallel_state as ps

    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and _uses_distributed_optimizer(optimizer):
        # 0.16.1 rejects its default 'fully_sharded_model_space'. dp_reshardable reshards across DP x CP only;
        # fully_reshardable across any layout, at the cost of gathering the state over DP x CP at each save.
        md["distrib_optim_sharding_type"] = optimizer_sharding
    if saved:  # loading: rebuild the state dict the way it was saved
        md.update({k: v for k, v in saved.items() if k in ("singleton_local_shards", "chained_optim_avoid_prefix",
                                                           "distrib_optim_sharding_type")})
    if ps.model_parallel_is_initialized():
        md["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return md


def _model_keys(model_chunks: list) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def _model_state(model_chunks: list, md: dict) -> dict:
    return {key: chunk.sharded_state_dict(metadata=md) for key, chunk in zip(_model_keys(model_chunks), model_chunks)}


def save_checkpoint(root: str | Path, iteration: int, model_chunks: list, *, optimizer=None, scheduler=None,
                    metadata: dict, extra: dict | None = None, keep_last: int | None = None,
                    async_queue=None, optimizer_sharding: str = "dp_reshardable") -> Path:
    """Save model (+ optimizer, scheduler, extra) as `root/iter_{iteration:07d}` and point `latest` at it.

    Collective: every rank calls it. `model_chunks` are unwrapped GPTModels (one per virtual stage).
    `metadata` goes to the JSON metadata file; it should hold `hf_config` (the model's HF config with
    rope scaling) and may hold `recipe` (resolved, dict or dataclass) and `tokenizer` (a location).
    `extra` must be plain data (numbers, strings, tensors, dicts/lists of them): it is loaded back
    with `torch.load(weights_only=True)`. `keep_last=N` then deletes all but the newest N `iter_*` folders.
    With `async_queue` (Megatron-Core's `AsyncCallsQueue`) the shards are written by a background process:
    the folder appears, and `latest` moves, when the queue finalises the save (see `save_sharded_state`).
    `optimizer_sharding` (`checkpoint.optimizer_sharding`) is how a distributed optimizer's state is saved; the
    metadata records it.
    """
    if "hf_config" not in metadata:
        raise CheckpointError("save_checkpoint: metadata must contain 'hf_config' (the model's HF config dict)")
    md = _sharding_metadata(optimizer, optimizer_sharding=optimizer_sharding)
    state: dict[str, Any] = _model_state(model_chunks, md)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=md)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if extra is not None:
        state["extra"] = extra
    info = {"model_chunks": len(model_chunks), "has_optimizer": optimizer is not None, **metadata}
    if "distrib_optim_sharding_type" in md:
        info["optimizer_sharding"] = md["distrib_optim_sharding_type"]
    return save_sharded_state(root, iteration, state, metadata=info, sharding_metadata=md, keep_last=keep_last,
                              async_queue=async_queue)


def save_sharded_state(root: str | Path, iteration: int, state: dict, *, metadata: dict,
                       sharding_metadata: dict | None = None, keep_last: int | None = None, async_queue=None) -> Path:
    """Write a ready sharded state dict as `root/iter_{iteration:07d}` (temp dir + rename) and update `latest`.

    The layer under `save_checkpoint`; the converter uses it directly with tensors it built itself.
    With `async_queue` the shards are written in the background: Megatron-Core copies GPU tensors to host
    memory and forks a writer, whose copy-on-write view of host memory stays as it was, so training may
    change the tensors at once. Everything from the completeness check on runs as the request's last
    finalize step, on every rank, when the queue finalises it.
    Returns the folder's final path (with `async_queue`: where it will be).
    """
    from megatron.core import dist_checkpointing

    md = sharding_metadata if sharding_metadata is not None else _sharding_metadata(None)
    root = Path(root)
    final = root / iter_dir_name(iteration)
    tmp = root / f".{final.name}.partial"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
        tmp.mkdir()
    _barrier()
    start_write_results_queue()
    content = {k: v for k, v in md.items() if k != "dp_cp_group"}
    strategy = _save_strategy(md.get("dp_cp_group"))
    need = local_bytes(state)
    finish = functools.partial(_finish_save, root, iteration, tmp, metadata, keep_last, need)
    checked = functools.partial(space_checked, root=root, iteration=iteration, tmp=tmp, need=need)
    if async_queue is None:
        # The writers it forks get Ctrl-C and scancel too and leave them to us: stop them if one ends the save.
        with children_killed_on_interrupt():
            checked(dist_checkpointing.save)(state, str(tmp), sharded_strategy=strategy, content_metadata=content)
        _barrier()
        finish()
    else:
        request = dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy, content_metadata=content,
                                          async_sharded_save=True)
        # Megatron-Core's finalisation raises the background writers' failures, on every rank
        request.finalize_fns[:] = [checked(fn) for fn in request.finalize_fns]
        request.add_finalize_fn(finish)
        async_queue.schedule_async_request(request)
    return final


def _save_strategy(replica_group):
    """Megatron-Core's torch_dist save strategy, spreading the writing of replicated tensors over `replica_group`
    (DP x CP) when it has several ranks (Megatron-LM's default `--ckpt-fully-parallel-save`).

    Without it the first replica writes every replicated tensor: at DP x CP = 32 one rank per TP x PP part
    wrote all model weights (and, saved fully_reshardable, the whole optimizer state) while 31 waited.
    """
    if replica_group is None or replica_group.size() == 1:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), replica_group)


def _load_strategy(path: Path, replica_group):
    """Megatron-Core's load strategy for `path`, each replica of `replica_group` (DP x CP) reading a share of the
    replicated tensors and broadcasting it to the others (Megatron-LM's `--ckpt-fully-parallel-load`).

    Without it a resume at DP x CP = 32 reads every TP x PP part's weights (and a fully_reshardable optimizer
    state) 32 times from the file system. None (each reads all) when the group is one rank.
    """
    if replica_group is None or replica_group.size() == 1:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), replica_group)


def start_write_results_queue() -> None:
    """Start Megatron-Core's checkpoint-writer result queue with SIGTERM and SIGUSR1 blocked in its server.

    The queue lives in a `multiprocessing.Manager` server process that dist_checkpointing spawns at the first
    save and keeps. Slurm delivers its pre-timeout USR1 (slurm/common.sh) and its TERM to every process of
    the job step, and the server had no handler: it died, and the save the signal asked for then failed
    (BrokenPipeError, no requeue) in every run that had saved before. A spawned process keeps the signal mask
    it was started with across exec, so this thread blocks both while it spawns the server: there they stay
    blocked for good. Here a signal that arrives meanwhile is delivered afterwards, or at once by another
    thread, to our handler. (Setting SIG_IGN instead lost it when another thread took it: the trainer's stop
    request, or a converter's SIGTERM, which then completed and exited 0.)
    """
    import signal
    from multiprocessing import resource_tracker

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    # The spawn starts the resource tracker if it is not running, and unblocks SIGTERM afterwards: start it first.
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        filesystem_async._get_write_results_queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _finish_save(root: Path, iteration: int, tmp: Path, metadata: dict, keep_last: int | None, need: int) -> None:
    """Collective, once every rank's shards are in `tmp`: metadata, completeness check, rename, `latest`.

    Rank 0 alone writes and renames; the others wait for its outcome (a broadcast), so a failure there is raised on
    every rank (a barrier left them waiting for the job's timeout when rank 0 raised, e.g. on a full disk)."""
    final = root / iter_dir_name(iteration)

    def write_metadata_and_check() -> dict | None:
        text = run_metadata_text(iteration, metadata)
        try:
            (tmp / METADATA_FILE).write_text(text)
        except OSError as e:
            if (verdict := space_verdict(e, root, tmp)) is None:
                raise
            return verdict
        complete_soon(tmp)
        return None

    # Every rank has written its shards; rank 0 checks that they are all there before anything is
    # renamed, and all ranks raise together if not (the previous checkpoint and pointer stay).
    verdict, problem = rank_zero_outcome(write_metadata_and_check, CheckpointError)
    if verdict is not None:
        raise alike_on_every_rank(CheckpointSpaceError(root, iteration, verdict, need))
    if problem is not None:
        raise alike_on_every_rank(CheckpointError(f"save of iteration {iteration} failed: {problem}"))

    def publish() -> dict | None:
        if final.exists():  # re-saving an iteration: keep the old one until the new one is in place
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        pointer = root / f".{LATEST_FILE}.tmp"
        try:
            pointer.write_text(f"{iteration}\n")
        except OSError as e:
            pointer.unlink(missing_ok=True)
            if (verdict := space_verdict(e, root, None, doing=f"pointing {LATEST_FILE} at iteration {iteration}",
                                         published=True)) is None:
                raise
            return verdict
        os.replace(pointer, root / LATEST_FILE)
        if keep_last:
            _prune(root, iteration, keep_last)
        return None

    verdict, problem = rank_zero_outcome(publish, CheckpointError)  # (rank 0 raises its own unexpected error)
    if verdict is not None:
        raise alike_on_every_rank(CheckpointSpaceError(root, iteration, verdict, None))
    if problem is not None:
        raise alike_on_every_rank(CheckpointError(f"save of iteration {iteration} failed: {problem}"))


def _prune(root: Path, iteration: int, keep_last: int) -> None:
    """Delete all but the newest `keep_last` iteration folders of `root` (never `iteration`), and what a killed
    prune left; errors are ignored (pruning must not fail the save)."""
    for doomed in root.glob(".iter_*.deleting"):  # what a killed save left
        shutil.rmtree(doomed, ignore_errors=True)
    for old_it in available_iterations(root)[:-keep_last]:
        if old_it != iteration:  # renamed first: a kill mid-delete leaves no half iter_* folder to pick
            doomed = root / f".{iter_dir_name(old_it)}.deleting"
            try:
                os.replace(root / iter_dir_name(old_it), doomed)
            except OSError:
                doomed = root / iter_dir_name(old_it)
            shutil.rmtree(doomed, ignore_errors=True)


@interrupts_unwrapped()  # Ctrl-C / SIGTERM mid-load: the interrupt, not torch's CheckpointException wrapping it
def load_checkpoint(root: str | Path, model_chunks: list, *, optimizer=None, scheduler=None,
                    iteration: int | None = None, weights_only: bool = False,
                    fully_parallel: bool = False) -> tuple[int, dict | None]:
    """Load `root`'s checkpoint (latest, or `iteration`) into unwrapped model chunks (+ optimizer, scheduler).

    Works at any TP/PP. `weights_only=True` loads the model only (starting a new run from it); an `optimizer`
    given then takes its main copies of the weights from them: a bf16 run's optimizer keeps fp32 copies, made
    when it was built, and its first step would otherwise write those (the random initial weights) back.
    `fully_parallel=True` (`checkpoint.fully_parallel_load`) spreads the reading of replicated tensors over the
    DP x CP replicas, which then exchange them; otherwise each replica reads them all.
    Returns (iteration, extra) where `extra` is what `save_checkpoint` was given (None if nothing).
    """
    from megatron.core import dist_checkpointing

    iteration, path = resolve_iteration_dir(root, iteration)
    # Rank 0 alone opens the files the index names (a resume at 512 ranks: ~1,000 files, not 512 x 1,000); each
    # rank reads the index once, allow-listed (vetted before torch unpickles it), and every check below uses it.
    index = read_dcp_index(path)  # vetted (pure-Python unpickling: ~10 s for a 512-rank index), read once
    if (problem := rank_zero_outcome(lambda: check_complete(path, index), CheckpointError)[1]) is not None:
        raise alike_on_every_rank(CheckpointError(problem))
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
        saved_md = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable torch_dist checkpoint ({type(e).__name__}: {e})") from None
    load_optim = optimizer is not None and not weights_only
    md = _sharding_metadata(optimizer if load_optim else None, saved_md)
    state: dict[str, Any] = _model_state(model_chunks, md)
    stored = check_fits(path, state, model_chunks, index)
    if load_optim:
        if "optimizer" not in common and not any(k.startswith("optimizer.") for k in stored):
            raise CheckpointError(f"{path} holds no optimizer state; resume with weights_only=True "
                                  "(checkpoint.init_from) instead")
        materialise_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=md)
    # a full load keeps the extra state the checkpoint holds (TE's FP8 scaling history); one saved where the module
    # had none (the sdpa backend's final norm, resumed with TE's) is skipped, not a missing-key failure
    skipped = _drop_extra_state(state, _model_keys(model_chunks), None if weights_only else _stored_keys(index))
    strategy = _load_strategy(path, md.get("dp_cp_group")) if fully_parallel else None
    try:
        loaded = dist_checkpointing.load(state, str(path), sharded_strategy=strategy)
    except CheckpointException as e:  # torch's read failures, gathered from every rank; one names no file
        if (error := read_failure_error(e, path, state, index)) is None:
            raise
        raise error from None
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        chunk.load_state_dict({**loaded[key], **dict.fromkeys(skipped.get(key, ()))})
    if optimizer is not None and weights_only:
        optimizer.reload_model_params()
    if load_optim:
        if md.get("distrib_optim_sharding_type") == "fully_reshardable":
            from megatron_ext.runtime.cpu_backend import keep_torch_adam_step_on_reshardable_load

            keep_torch_adam_step_on_reshardable_load()
        with torch.no_grad():  # fp32 main params are views of the (leaf) model params
            optimizer.load_state_dict(loaded["optimizer"])
        fit_loaded_optimizer_state(optimizer)
    if scheduler is not None and not weights_only:
        if "scheduler" not in loaded:
            raise CheckpointError(f"{path} holds no scheduler state; resume with weights_only=True instead")
        scheduler.load_state_dict(loaded["scheduler"])
    return iteration, loaded.get("extra")


def _drop_extra_state(state: dict, model_keys: list[str], stored: set[str] | None = None) -> dict[str, list[str]]:
    """Remove the modules' `_extra_state` objects from a load request (`stored` given: those the checkpoint does not
    hold); returns their names per model key, to be loaded as None.

    torch.distributed.checkpoint reads such objects with a full (not weights-only) torch load, i.e. it
    unpickles them. Weights-only loads (`checkpoint.init_from`, often a checkpoint from elsewhere) skip
    them: they hold nothing for the local spec and only FP8 scaling history for TE, which restarts.
    """
    skipped = {}
    for key in model_keys:
        names = [n for n in state[key] if n.endswith("._extra_state")
                 and (stored is None or getattr(state[key][n], "key", None) not in stored)]
        for n in names:
            del state[key][n]
        skipped[key] = names
    return skipped


def _stored_keys(index) -> set[str]:
    """The keys of what a torch_dist index (`read_dcp_index`) holds (tensors, objects; an object's shards as one)."""
    return {k.split("/shard_")[0] for k in index.state_dict_metadata}
