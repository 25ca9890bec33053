"""Where a run that finds a checkpoint in its `checkpoint.dir` goes on: one decision from the checkpoint's run
metadata (`megatron_ext.checkpoint.read_metadata`) and the recipe, used by the trainer and by
`tools/checkpoint.py info --recipe`, so what the tool says is what training does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_ext.checkpoint_index import optimizer_state_mismatch
from megatron_ext.recipe import Recipe

_DATA_IDENTITY = (("data", "prefix"), ("data", "weights"), ("data", "split"), ("train", "stage"),
                  ("train", "seq_length"), ("train", "seed"))
_ARCHITECTURE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size")


@dataclass(frozen=True)
class Resume:
    """What a run resumed at checkpoint step `step` does."""

    step: int
    saved_layout: dict | None  # {'tensor', 'pipeline', 'context', 'data'} of the checkpoint's run
    layout: dict  # the same of this run
    finished: bool  # step >= train.steps: nothing to train
    full_state: bool  # model, optimizer, scheduler; else the weights and a fresh optimizer state
    why_not_full: str | None
    consumed_samples: int
    tokens: int
    data_changed: list[str] = field(default_factory=list)  # 'field: old -> new'
    architecture_changed: list[str] = field(default_factory=list)  # the model does not fit: the load fails
    data_samples: int | None = None  # CPT: training samples the saved run's data order was built for
    order_warning: str | None = None  # when this run needs more samples than that order was built for


def data_request(saved: dict) -> int | None:
    """Training samples the checkpoint's run asked Megatron-Core's GPTDataset for (recorded since the samples
    were; before, a run never resumed with other settings asked for train.steps x global batch)."""
    if saved.get("data_samples") is not None:
        return int(saved["data_samples"])
    old_train = (saved.get("recipe") or {}).get("train") or {}
    if old_train.get("steps") and old_train.get("global_batch_size"):
        return int(old_train["steps"]) * int(old_train["global_batch_size"])
    return None


def _order_warning(saved: dict, step: int, consumed: int, recipe: Recipe) -> str | None:
    """The warning when this run needs more CPT samples than the saved run's data order was built for.

    GPTDataset shuffles over as many epochs of the data as the requested samples need, so a request needing
    more epochs orders every sample differently: the run then reads some samples again and skips others.
    Requests within the saved one are served from the saved order (`build_batches(min_train_samples=)`).
    """
    t = recipe.train
    built = data_request(saved)
    needed = consumed + (t.steps - step) * t.global_batch_size
    if t.stage != "cpt" or built is None or needed <= built:
        return None
    return (f"train.steps x train.global_batch_size: this run reads {needed} samples, its checkpoint's data order "
            f"was built for {built}; if that takes more epochs of the data, Megatron-Core's GPTDataset orders "
            "the samples differently from here on (some repeat, some are skipped): set train.steps to the most "
            "you may train when a run starts")


def resume_position(saved: dict, step: int, recipe: Recipe) -> tuple[int, int, list[str]]:
    """Where a run resumed at `step` from a checkpoint with run metadata `saved` goes on in its data:
    (samples consumed, tokens seen, the data settings that changed since, as 'field: old -> new').

    Checkpoints record both counts; older ones are counted at their recipe's global batch. A changed
    data setting gives another sample order, in which the run goes on at the same sample count.
    """
    old = saved.get("recipe") or {}
    old_train = old.get("train") or {}
    consumed = saved.get("consumed_samples")
    if consumed is None:
        consumed = step * old_train.get("global_batch_size", recipe.train.global_batch_size)
    tokens = saved.get("tokens")
    if tokens is None:
        tokens = consumed * old_train.get("seq_length", recipe.train.seq_length)
    changed = []
    for section, key in _DATA_IDENTITY:
        saved_section = old.get(section) or {}
        now = getattr(getattr(recipe, section), key)
        if key in saved_section and not _same_setting(key, saved_section[key], now):
            shown = list(now) if isinstance(now, tuple) else now
            changed.append(f"{section}.{key}: {saved_section[key]!r} -> {shown!r}")
    return int(consumed), int(tokens), changed


def _same_setting(key: str, saved, now) -> bool:
    """Equal values (a saved list and a recipe's tuple alike); for data.prefix also two spellings of one dataset
    (relative and absolute, links), each of a blend's."""
    now = list(now) if isinstance(now, tuple) else now
    if saved == now:
        return True
    if key == "prefix" and isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(_same_setting(key, a, b) for a, b in zip(saved, now))
    if key == "prefix" and isinstance(saved, str) and isinstance(now, str):
        try:
            return os.path.samefile(saved + ".bin", now + ".bin")
        except OSError:  # gone, or on another machine: the text decides
            return False
    return False


def plan_resume(saved: dict, step: int, recipe: Recipe, data_parallel: int) -> Resume:
    """The resume of `recipe` at `data_parallel` DP ranks from a checkpoint at `step` with metadata `saved`."""
    from megatron_ext.model import hf_config_from_recipe, normalize_hf_config

    p, t = recipe.parallel, recipe.train
    layout = {"tensor": p.tensor, "pipeline": p.pipeline, "context": p.context, "data": data_parallel}
    why_not = optimizer_state_mismatch(saved, layout, t.distributed_optimizer, t.precision)
    consumed, tokens, data_changed = resume_position(saved, step, recipe)
    arch = []
    if saved.get("hf_config"):
        old, new = normalize_hf_config(saved["hf_config"]), normalize_hf_config(hf_config_from_recipe(recipe))
        arch = [f"{k}: {old.get(k)} -> {new.get(k)}" for k in _ARCHITECTURE if old.get(k) != new.get(k)]
    return Resume(step, saved.get("parallel"), layout, step >= t.steps, why_not is None, why_not, consumed, tokens,
                  data_changed, arch, data_request(saved) if t.stage == "cpt" else None,
                  _order_warning(saved, step, consumed, recipe))
