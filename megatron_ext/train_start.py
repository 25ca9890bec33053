"""Where a training run starts: resumed from its own `checkpoint.dir` (the latest iteration; the full state, or the
weights alone where the optimizer state cannot follow the layout), initialised from `checkpoint.init_from` (weights,
fresh optimizer), or from scratch. Says in the log what it loaded and what changed since (data, RoPE, schedule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.checkpoint import CheckpointError, load_checkpoint
from megatron_ext.checkpoint_layout import carry_forward, read_metadata, resolve_iteration_dir
from megatron_ext.recipe import Recipe
from megatron_ext.resume import Resume, agreed_latest_iteration, plan_resume, rope_changes
from megatron_ext.runtime.distributed import alike_on_every_rank, rank_zero_outcome
from megatron_ext.train_metrics import log


@dataclass(frozen=True)
class StartPoint:
    """The step a run goes on from, the data position there, and whether `checkpoint.dir` is already done."""

    step: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    data_samples: int = 0  # CPT: training samples the saved run's data order was built for (0: none saved)
    finished: bool = False  # at train.steps already (`step`): nothing to train


def start_point(recipe: Recipe, model, optimizer, scheduler, metadata: dict, data_now: dict,
                dp_size: int) -> StartPoint:
    """Load what the run starts from into `model` / `optimizer` / `scheduler` (every rank calls it) and return
    where it starts. `metadata` (the run's, for its saves) takes what carries forward from the checkpoint;
    `data_now`: the recipe's `data_identities` (rank 0's; {} elsewhere: rank 0 plans a resume for all).
    CheckpointError for a checkpoint of another model, or of another stage's run."""
    root = Path(recipe.checkpoint.dir)
    done = agreed_latest_iteration(root)
    if done is not None:
        return _resume(recipe, root, done, model, optimizer, scheduler, metadata, data_now, dp_size)
    if recipe.checkpoint.init_from:
        _initialise(recipe, model, optimizer, metadata)
    return StartPoint()


def _resume(recipe: Recipe, root: Path, done: int, model, optimizer, scheduler, metadata: dict, data_now: dict,
            dp_size: int) -> StartPoint:
    """Go on from `root`'s iteration `done`: the whole state where it follows the layout, else the weights."""
    t = recipe.train

    def plan() -> tuple[dict, Resume]:
        # its own error where the latest pointer names a folder that is gone ('has no iteration N; available: ...')
        saved = read_metadata(resolve_iteration_dir(root, done)[1])
        return saved, plan_resume(saved, done, recipe, dp_size, data_now)

    # Rank 0's plan on every rank: it alone has read the data's identities (`data_now`) and, for the warnings,
    # the document lengths (200 MB at 100B tokens, not 512 reads of them); a refusal is said once.
    found, problem = rank_zero_outcome(plan, CheckpointError)
    if problem is not None:
        raise alike_on_every_rank(CheckpointError(problem))
    saved, resume = found
    if resume.stage_refusal:  # before `finished`: a finished CPT folder given to an SFT ended at once, exit 0
        raise alike_on_every_rank(CheckpointError(resume.stage_refusal))  # rank 0's plan: alike everywhere
    if resume.finished:  # the trainer says so, once no signal can change its outcome (StopFlag.settle)
        return StartPoint(step=done, finished=True)
    if resume.architecture_changed:
        raise alike_on_every_rank(CheckpointError(f"checkpoint.dir = {str(root)!r} holds another model "
                              f"({'; '.join(resume.architecture_changed)}): use the checkpoint's model.* "
                              "settings, or a new checkpoint.dir (with checkpoint.init_from for a new stage)"))
    began = time.time()
    position = f"sample {resume.consumed_samples:,}, {resume.tokens:,} tokens trained"
    log(f"[train] loading {root}/iter_{done:07d} ...")  # minutes at scale: not a hang
    if resume.full_state:
        start, _ = load_checkpoint(root, [model], optimizer=optimizer, scheduler=scheduler, iteration=done,
                                   fully_parallel=recipe.checkpoint.fully_parallel_load)
        log(f"[train] resumed from {root} at step {start} ({position}; {time.time() - began:.1f} s)" + (
            f" (parallel layout {resume.saved_layout} -> {resume.layout})"
            if resume.saved_layout != resume.layout else ""))
    else:
        start, _ = load_checkpoint(root, [model], optimizer=optimizer, iteration=done, weights_only=True,
                                   fully_parallel=recipe.checkpoint.fully_parallel_load)
        scheduler.step(increment=start)
        log(f"[train] resumed weights from {root} at step {start} ({position}; {time.time() - began:.1f} s) "
            f"with a fresh optimizer state: {resume.why_not_full}")
    # The recipe's schedule and Adam settings win over those saved in the optimizer's param groups (loading
    # them replaced the groups' betas and eps with the saved run's).
    for group in optimizer.param_groups:
        group["max_lr"], group["min_lr"] = t.lr, t.min_lr
        group["betas"], group["eps"] = (t.adam_beta1, t.adam_beta2), t.adam_eps
    scheduler.step(increment=0)
    carry_forward(metadata, saved)
    begin = StartPoint(start, resume.consumed_samples, resume.tokens, resume.data_samples or 0)
    if resume.data_changed:
        log(f"[train] warning: {'; '.join(resume.data_changed)} since the checkpoint: the run goes on at "
            f"sample {begin.consumed_samples} of another sample order (for a new stage, use a new checkpoint.dir "
            "with checkpoint.init_from)")
    for warning in (resume.order_warning, resume.schedule_warning):
        if warning:
            log(f"[train] warning: {warning}")
    if resume.rope_changed:
        log(f"[train] warning: the recipe's RoPE differs from the checkpoint's ({'; '.join(resume.rope_changed)}):"
            " the run goes on with positions its weights were not trained with so far")
    return begin


def _initialise(recipe: Recipe, model, optimizer, metadata: dict) -> None:
    """The weights of another run (a converted HF model, the CPT before an SFT), with a fresh optimizer."""
    t = recipe.train
    began = time.time()
    log(f"[train] loading {recipe.checkpoint.init_from} ...")
    load_checkpoint(Path(recipe.checkpoint.init_from), [model], optimizer=optimizer, weights_only=True,
                    fully_parallel=recipe.checkpoint.fully_parallel_load)
    try:
        source = read_metadata(recipe.checkpoint.init_from)
    except CheckpointError:
        source = {}
    carry_forward(metadata, source)
    log(f"[train] initialised weights from {recipe.checkpoint.init_from} ({time.time() - began:.1f} s; fresh "
        "optimizer)")
    changed = rope_changes(source.get("hf_config"), recipe)
    if t.stage == "sft" and changed:  # CPT changes the RoPE on purpose; SFT keeps its checkpoint's
        log(f"[train] warning: SFT with another RoPE than checkpoint.init_from's ({'; '.join(changed)}); "
            "keep the checkpoint's rope.* (recipes/README.md), unless this is meant")
