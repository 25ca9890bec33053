"""Where a run that finds a checkpoint in its `checkpoint.dir` goes on: one decision from the checkpoint's run
metadata (`megatron_ext.checkpoint_layout.read_metadata`) and the recipe, used by the trainer and by
`tools/checkpoint.py info --recipe`, so what the tool says is what training does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron_ext.checkpoint_index import gradient_bucket_size, optimizer_state_mismatch
from megatron_ext.recipe import Recipe
from megatron_ext.rope_spec import ANGLE_PRECISION_KEY

_DATA_IDENTITY = (("data", "prefix"), ("data", "weights"), ("data", "split"), ("train", "stage"),
                  ("train", "seq_length"), ("train", "seed"))
_ARCHITECTURE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


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
    # 'field: old -> new'; 'data.prefix P: contents changed (...)' for data prepared again under the same prefix
    data_changed: list[str] = field(default_factory=list)
    architecture_changed: list[str] = field(default_factory=list)  # the model does not fit: the load fails
    data_samples: int | None = None  # CPT: training samples the saved run's data order was built for
    order_warning: str | None = None  # when this run needs more samples than that order was built for
    rope_changed: list[str] = field(default_factory=list)  # 'rope_theta: old -> new': the weights load, the
    # positions they were trained with change
    schedule_warning: str | None = None  # train.steps changed under a decaying learning rate
    stage_refusal: str | None = None  # the checkpoint is another stage's run: resuming it would train that run on
    # (its optimizer state, data position and schedule) as this stage, and `checkpoint.init_from` would go unread


def _schedule_warning(saved: dict, step: int, recipe: Recipe) -> str | None:
    """The warning when train.steps changed under a decaying schedule: the decay runs over train.steps, so the
    learning rate jumps at the resume (e.g. raising train.steps to go on with a finished cosine run)."""
    t = recipe.train
    old = ((saved.get("recipe") or {}).get("train") or {}).get("steps")
    if t.lr_schedule == "constant" or old is None or int(old) == t.steps:
        return None
    return (f"train.steps {old} -> {t.steps} with the {t.lr_schedule} learning-rate schedule, which decays over "
            f"train.steps: from step {step} on the rate follows the new curve (a jump at the resume, not the "
            "continuation of the saved run's decay)")


def data_request(saved: dict) -> int | None:
    """Training samples the checkpoint's run asked Megatron-Core's GPTDataset for (recorded since the samples
    were; before, a run never resumed with other settings asked for train.steps x global batch)."""
    if saved.get("data_samples") is not None:
        return int(saved["data_samples"])
    old_train = (saved.get("recipe") or {}).get("train") or {}
    if old_train.get("steps") and old_train.get("global_batch_size"):
        return int(old_train["steps"]) * int(old_train["global_batch_size"])
    return None


def train_split_epochs(recipe: Recipe, samples: int) -> int | None:
    """Epochs of the train split GPTDataset goes through to serve `samples` CPT samples: the fewest whose tokens
    reach samples x seq_length + 1 (its count), or None for a blend or data that cannot be read here."""
    per_epoch = train_split_tokens(recipe)
    if per_epoch is None:
        return None
    return max(1, -(-(samples * recipe.train.seq_length + 1) // per_epoch))


def train_split_tokens(recipe: Recipe) -> int | None:
    """Tokens of the CPT train split (one epoch), or None for a blend or data that cannot be read here."""
    from megatron_ext.data.common import split_range
    from megatron_ext.data.dataset_files import check_complete

    d = recipe.data
    if d.weights is not None or len(d.prefixes) != 1:
        return None
    try:
        lengths = np.array(check_complete(d.prefixes[0]).sequence_lengths, dtype=np.int64)
    except Exception:  # gone or unreadable: the trainer reports it when it opens the data
        return None
    docs = split_range(lengths.size, d.split, 0)
    per_epoch = int(lengths[docs.start:docs.stop].sum())
    return per_epoch if per_epoch > 0 else None


def _order_warning(saved: dict, step: int, consumed: int, recipe: Recipe) -> str | None:
    """The warning when this run needs more CPT samples than the saved run's data order was built for, and so
    perhaps another order: GPTDataset shuffles over all the epochs of the data a request needs, so one needing
    another number of epochs orders every sample differently (the run then reads some samples again and skips
    others). Within one epoch both ways the order is the same. Requests within the saved one are served from
    the saved order (`build_batches(min_train_samples=)`).
    """
    t = recipe.train
    built = data_request(saved)
    needed = consumed + (t.steps - step) * t.global_batch_size
    if t.stage != "cpt" or built is None or needed <= built:
        return None
    epochs = (train_split_epochs(recipe, built), train_split_epochs(recipe, needed))
    if epochs == (1, 1):
        return None
    known = epochs[0] is not None and epochs[1] is not None
    return (f"train.steps x train.global_batch_size: this run reads {needed} samples, its checkpoint's data order "
            f"was built for {built}" + (f" ({epochs[1]} epochs of the data instead of {epochs[0]}): " if known else
                                        "; if that takes more epochs of the data, ")
            + "Megatron-Core's GPTDataset orders the samples differently from here on (some repeat, some are "
            "skipped): set train.steps to the most you may train when a run starts")


def resume_position(saved: dict, step: int, recipe: Recipe,
                    data_now: dict[str, dict] | None = None) -> tuple[int, int, list[str]]:
    """Where a run resumed at `step` from a checkpoint with run metadata `saved` goes on in its data:
    (samples consumed, tokens seen, the data settings that changed since, as 'field: old -> new', and the data
    prefixes whose contents changed, as 'data.prefix P: contents changed (...)').

    Checkpoints record both counts; older ones are counted at their recipe's global batch. A changed
    data setting gives another sample order, in which the run goes on at the same sample count. A data.prefix
    at another path holding the recorded contents (data moved) is the same data: GPTDataset orders samples by
    the contents and the seed, not the path.
    `data_now`: `data_identities(recipe)` when the caller has them (else read here, if the checkpoint recorded
    any); {} compares no contents.
    """
    old = saved.get("recipe") or {}
    old_train = old.get("train") or {}
    consumed = saved.get("consumed_samples")
    if consumed is None:
        consumed = step * old_train.get("global_batch_size", recipe.train.global_batch_size)
    tokens = saved.get("tokens")
    if tokens is None:
        tokens = consumed * old_train.get("seq_length", recipe.train.seq_length)
    recorded = saved.get("data_identity") or {}  # older checkpoints: none, and nothing to read
    if data_now is None:
        data_now = data_identities(recipe) if recorded else {}

    def same_dataset(a: str, b: str) -> bool:
        return _same_path(a, b) or _contents_equal(recorded.get(a), data_now.get(b)) is True

    changed = []
    for section, key in _DATA_IDENTITY:
        saved_section = old.get(section) or {}
        now = getattr(getattr(recipe, section), key)
        if key in saved_section and not _same_setting(key, saved_section[key], now, same_dataset):
            shown = list(now) if isinstance(now, tuple) else now
            changed.append(f"{section}.{key}: {saved_section[key]!r} -> {shown!r}")
    return int(consumed), int(tokens), changed + _contents_changed(recorded, data_now)


def data_identities(recipe: Recipe) -> dict[str, dict]:
    """`dataset_files.data_identity` of each of `recipe`'s data prefixes that can be read here, by prefix: recorded in
    the checkpoint metadata (`data_identity`) and compared on resume."""
    from megatron_ext.data.dataset_files import data_identity

    found = {p: data_identity(p) for p in recipe.data.prefixes}
    return {p: identity for p, identity in found.items() if identity is not None}


def _contents_equal(old: dict | None, new: dict | None) -> bool | None:
    """Whether two data identities show the same contents; None when either is unknown. Only the fields both
    have are compared, so an identity with more fields (a later version) still compares."""
    common = (old or {}).keys() & (new or {}).keys()
    if not common:
        return None
    return all(old[k] == new[k] for k in common)


def _contents_changed(recorded: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """'data.prefix P: contents changed (...)' for each of this run's prefixes at the path of a recorded one whose
    contents differ from the recorded (`tools/prepare_data.py ... --force` under the same prefix)."""
    out = []
    for prefix, new in now.items():
        old = next((recorded[p] for p in recorded if _same_path(p, prefix)), None)
        if _contents_equal(old, new) is False:
            tokenizer = old.get("tokenizer_hash") not in (None, new.get("tokenizer_hash"))
            out.append(f"data.prefix {prefix}: contents changed ({_counts(old)} -> {_counts(new)}"
                       + (", another tokenizer" if tokenizer else "") + f"; {prefix}.bin/.idx prepared again? "
                       "restore the checkpoint's data to read on in its order)")
    return out


def _counts(identity: dict) -> str:
    """'120 documents, 48,453 tokens' of a data identity."""
    return ", ".join(f"{identity[k]:,} {k}" if isinstance(identity.get(k), int) else f"? {k}"
                     for k in ("documents", "tokens"))


def _same_setting(key: str, saved, now, same_dataset: Callable[[str, str], bool]) -> bool:
    """Equal values (a saved list and a recipe's tuple alike); for data.prefix also one dataset each of a blend's
    (`same_dataset`: two spellings of one path, a copy with the recorded contents)."""
    now = list(now) if isinstance(now, tuple) else now
    if saved == now:
        return True
    if key == "prefix" and isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(_same_setting(key, a, b, same_dataset) for a, b in zip(saved, now))
    if key == "prefix" and isinstance(saved, str) and isinstance(now, str):
        return same_dataset(saved, now)
    return False


def _same_path(saved: str, now: str) -> bool:
    """Two spellings of one dataset PREFIX (relative and absolute, links)."""
    if saved == now:
        return True
    try:
        return os.path.samefile(saved + ".bin", now + ".bin")
    except OSError:  # gone, or on another machine: the text decides
        return False


_ROPE = ("rope_theta", "rope_scaling", "max_position_embeddings", ANGLE_PRECISION_KEY)
_ABSENT_MEANS = {ANGLE_PRECISION_KEY: "float64"}  # keys our configs write only when not the default


def _config_changes(saved_hf_config: dict | None, recipe: Recipe, keys: tuple[str, ...]) -> list[str]:
    """`keys` of `recipe`'s HF config that differ from a checkpoint's ('key: old -> new'; none without one)."""
    from megatron_ext.hf_config import hf_config_from_recipe, normalize_hf_config

    if not saved_hf_config:
        return []
    old, new = normalize_hf_config(saved_hf_config), normalize_hf_config(hf_config_from_recipe(recipe))
    old, new = ({k: c.get(k) if c.get(k) is not None else _ABSENT_MEANS.get(k) for k in keys} for c in (old, new))
    return [f"{k}: {old[k]} -> {new[k]}" for k in keys if old[k] != new[k]]


def rope_changes(saved_hf_config: dict | None, recipe: Recipe) -> list[str]:
    """The RoPE settings of `recipe`'s model that differ from a checkpoint's HF config ('key: old -> new')."""
    return _config_changes(saved_hf_config, recipe, _ROPE)


def architecture_changes(saved_hf_config: dict | None, recipe: Recipe) -> list[str]:
    """The model sizes of `recipe` that differ from a checkpoint's HF config ('key: old -> new'): such a checkpoint
    does not load into the recipe's model (or, for tie_word_embeddings, loads without its output layer)."""
    return _config_changes(saved_hf_config, recipe, _ARCHITECTURE)


def stage_refusal(saved: dict, step: int, recipe: Recipe, root: str | None = None) -> str | None:
    """The refusal when the checkpoint in `root` (default: `recipe`'s checkpoint.dir) is a run of another stage
    (an SFT recipe given the CPT's folder as checkpoint.dir): as a resume it would go on with the CPT's optimizer
    state and step count, or do nothing at all when they are finished, and never read checkpoint.init_from. None
    for the same stage, or a checkpoint that recorded none (older ones)."""
    old = saved.get("recipe") or {}
    before = (old.get("train") or {}).get("stage")
    now = recipe.train.stage
    if not before or before == now:
        return None
    root = recipe.checkpoint.dir if root is None else str(root)
    name = f"recipe {old['name']!r}, " if old.get("name") else ""
    return (f"checkpoint.dir = {root!r} holds a {before} run ({name}step {step}); this recipe is stage {now}: give "
            f"a new checkpoint.dir (checkpoint.init_from={root} loads its weights)")


def plan_resume(saved: dict, step: int, recipe: Recipe, data_parallel: int,
                data_now: dict[str, dict] | None = None, root: str | None = None) -> Resume:
    """The resume of `recipe` at `data_parallel` DP ranks from a checkpoint at `step` with metadata `saved`.

    `data_now`: the recipe's `data_identities`, if the caller has read them (see `resume_position`). `root`: the
    checkpoint's folder, for the words of a refusal (default: the recipe's checkpoint.dir)."""
    p, t = recipe.parallel, recipe.train
    layout = {"tensor": p.tensor, "pipeline": p.pipeline, "context": p.context, "data": data_parallel}
    why_not = optimizer_state_mismatch(saved, layout, t.distributed_optimizer, t.precision,
                                       gradient_bucket_size(t.overlap_grad_reduce, t.ddp_bucket_size, data_parallel))
    consumed, tokens, data_changed = resume_position(saved, step, recipe, data_now)
    arch = architecture_changes(saved.get("hf_config"), recipe)
    return Resume(step, saved.get("parallel"), layout, step >= t.steps, why_not is None, why_not, consumed, tokens,
                  data_changed, arch, data_request(saved) if t.stage == "cpt" else None,
                  _order_warning(saved, step, consumed, recipe), rope_changes(saved.get("hf_config"), recipe),
                  _schedule_warning(saved, step, recipe), stage_refusal(saved, step, recipe, root))


def agreed_latest_iteration(root) -> int | None:
    """The latest iteration of `root` as rank 0 reads it, on every rank (all call it): a node whose view of a shared
    file system lags a save must not start over, or resume another iteration, while the others resume."""
    from megatron_ext.checkpoint_index import CheckpointError
    from megatron_ext.checkpoint_layout import latest_iteration
    from megatron_ext.runtime.distributed import alike_on_every_rank, rank_zero_outcome

    found, problem = rank_zero_outcome(lambda: latest_iteration(root), CheckpointError)
    if problem is not None:  # raised on every rank (said once), not a hang of the others in the broadcast
        raise alike_on_every_rank(CheckpointError(problem))
    return found
