"""Typed recipes: YAML -> frozen dataclasses, `extends:`, dotted overrides, validation.

A recipe is data. Every field below has a type and a docstring (`metadata["doc"]`); unknown keys,
wrong types and impossible layouts are `RecipeError`s raised at load, before any process group or
allocation. Each error is one line naming the field path, the value and what would be valid.

    recipe = load_recipe("recipes/cpt_4m.yaml", ["train.steps=10"], world_size=256)

Command line: `python -m megatron_ext.recipe check FILE... [--world-size N] [--set KEY=VALUE ...]`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_ext.presets import PRESETS, ROPE_PRESETS
from megatron_ext.recipe_files import resolve_extends
from megatron_ext.recipe_schema import RecipeError, bad_value, build, unknown_key


def _f(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture, in Hugging Face Llama `config.json` names. `preset` or `hf_config` fill unset fields."""

    preset: str | None = _f(None, f"Architecture preset: one of {sorted(PRESETS)}; fills every field left unset.")
    hf_config: str | None = _f(None, "Path to an HF `config.json` (or its folder); fills every field left unset.")
    tokenizer: str | None = _f(None, "HF tokenizer folder or name (used by data preparation, SFT and evaluation).")
    num_hidden_layers: int | None = _f(None, "Transformer layers.")
    hidden_size: int | None = _f(None, "Model width.")
    intermediate_size: int | None = _f(None, "SwiGLU FFN width.")
    num_attention_heads: int | None = _f(None, "Query heads.")
    num_key_value_heads: int | None = _f(None, "Key/value heads (GQA groups); defaults to num_attention_heads.")
    head_dim: int | None = _f(None, "Per-head width; defaults to hidden_size / num_attention_heads.")
    vocab_size: int | None = _f(None, "Tokenizer vocabulary size (before padding).")
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_word_embeddings: bool = _f(False, "Share input embedding and output layer weights.")
    max_position_embeddings: int | None = _f(None, "Context length the model advertises (HF config field).")
    initializer_range: float = _f(0.02, "Std of the normal init for a model trained from scratch.")
    make_vocab_size_divisible_by: int = _f(
        128, "Pad the embedding rows to a multiple of both this and parallel.tensor (TP-portable); 1 = no padding."
    )


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding, in HF names (`rope_theta` + the `rope_scaling` fields). Replaced as a whole by `extends`."""

    preset: str | None = _f(None, f"Named rope block, one of {sorted(ROPE_PRESETS)} (UltraLong YaRN); it replaces "
                                  "the inherited rope, and fields set next to it override it.")
    rope_theta: float = _f(10000.0, "RoPE base frequency theta; left out, the model preset's / HF config's.")
    rope_type: Literal["default", "linear", "dynamic", "yarn", "longrope", "llama3"] = _f(
        "default", f"Scaling method: one of {list(ROPE_TYPES)}."
    )
    factor: float | None = _f(None, "Scaling factor s (linear, dynamic, yarn, longrope, llama3).")
    original_max_position_embeddings: int | None = _f(None, "Context length before scaling (yarn, longrope, llama3).")
    low_freq_factor: float | None = _f(None, "llama3: low-frequency factor.")
    high_freq_factor: float | None = _f(None, "llama3: high-frequency factor.")
    beta_fast: float | None = _f(None, "yarn: ramp bound beta (HF default 32; UltraLong uses 4).")
    beta_slow: float | None = _f(None, "yarn: ramp bound alpha (HF default 1).")
    mscale: float | None = _f(None, "yarn: mscale (DeepSeek-style attention factor).")
    mscale_all_dim: float | None = _f(None, "yarn: mscale_all_dim.")
    attention_factor: float | None = _f(None, "yarn/longrope: explicit attention (cos/sin) factor.")
    truncate: bool | None = _f(None, "yarn: round the correction range to integers (HF default true).")
    short_factor: tuple[float, ...] | None = _f(None, "longrope: per-frequency factors for short contexts.")
    long_factor: tuple[float, ...] | None = _f(None, "longrope: per-frequency factors for long contexts.")
    partial_rotary_factor: float = _f(1.0, "Fraction of head_dim that is rotated; left out, the model's.")
    angle_precision: Literal["float64", "float32"] = _f(
        "float64", "How each angle, position x frequency, is formed: float64 (exact; reduced mod 2 pi, then rounded "
                   "once) or float32 (the product transformers, vLLM and stock Megatron-Core form, so the model trains "
                   "with the phases it is served with; near 1M / 4M tokens the two differ by up to 0.031 / 0.125 "
                   "rad). Left out, the model's (`rope_angle_precision` in its config.json; absent: float64).")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallel layout; data parallel size is what remains of the world size."""

    tensor: int = _f(1, "Tensor parallel size (TP).")
    pipeline: int = _f(1, "Pipeline parallel size (PP).")
    context: int = _f(1, "Context parallel size (CP): each sequence is split over this many ranks.")
    cp_comm_type: Literal["p2p", "a2a", "all_gather", "a2a+p2p"] = _f(
        "p2p", f"Context-parallel attention communication: one of {list(CP_COMM_TYPES)}."
    )
    hierarchical_context_sizes: tuple[int, ...] | None = _f(
        None, "For cp_comm_type a2a+p2p: [a2a size, p2p size], product = context."
    )
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism (needs TP > 1 and Transformer Engine).")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the recipe is meant to run (Slurm headers, planner, static layout checks)."""

    nodes: int = _f(1, "Nodes.")
    gpus_per_node: int = _f(8, "Processes (GPUs) per node.")
    gpu: Literal["h100-80gb", "h200-141gb", "b200-180gb"] | None = _f(
        None, "GPU model, for the planner (`tools/plan.py`): h100-80gb, h200-141gb or b200-180gb; null = not stated."
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and schedule."""

    stage: Literal["cpt", "sft"] = _f("cpt", "cpt: fixed-length samples crossing documents; sft: packed chat samples.")
    seq_length: int = _f(None, "Tokens per sequence (required).")
    global_batch_size: int = _f(1, "Sequences per optimizer step, over all data-parallel ranks.")
    micro_batch_size: int = _f(1, "Sequences per forward pass on one rank.")
    steps: int = _f(None, "Optimizer steps (required).")
    lr: float = _f(None, "Peak learning rate (required).")
    min_lr: float = _f(0.0, "Final learning rate of linear/cosine decay.")
    lr_schedule: Literal["constant", "linear", "cosine"] = _f("constant", "Decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    weight_decay: float = _f(0.1, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.95, "AdamW beta2.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Global gradient-norm clip; 0 disables.")
    seed: int = _f(1234, "Random seed (init, data order).")
    precision: Literal["bf16", "fp32"] = _f("bf16", "Parameter/compute dtype; optimizer state is fp32.")
    recompute: Literal["none", "selective", "full"] = _f("none", "Activation recomputation.")
    recompute_layers: int | None = _f(
        None, "With recompute: full, recompute only the first N layers of each pipeline stage (Megatron's block "
        "method); the others keep their activations: less recompute where memory allows (tools/plan.py "
        "suggests N). null: every layer.")
    loss_head: Literal["chunked", "full"] = _f(
        "chunked", "chunked: logits formed loss_chunk_tokens at a time and freed (formed again in backward); "
        "full: Megatron's output layer and cross entropy (6 B x vocab/TP per token at the forward peak).")
    loss_chunk_tokens: int = _f(2048, "Tokens per logits chunk of the chunked loss head.")
    distributed_optimizer: bool = _f(True, "Shard optimizer state over data-parallel ranks.")
    overlap_grad_reduce: bool = _f(
        False, "Reduce the gradients over data-parallel ranks bucket by bucket during the last microbatch's "
        "backward, as each bucket's gradients are ready, instead of after it.")
    overlap_param_gather: bool = _f(
        False, "Distributed optimizer: gather the updated parameters bucket by bucket during the next forward "
        "instead of after the optimizer step (needs overlap_grad_reduce).")
    ddp_bucket_size: int | None = _f(
        None, "Parameters per gradient bucket with overlap_grad_reduce (null: Megatron-Core's, max(40M, 1M x DP)). "
        "The distributed optimizer's saved state follows the buckets: changing this or overlap_grad_reduce "
        "resumes with a fresh optimizer state.")
    log_interval: int = _f(1, "Print a progress line every this many steps (loss and rates over those steps; "
                              "metrics.jsonl has every step).")
    eval_interval: int = _f(0, "Validation loss on data.split's valid documents every this many steps and at the "
                               "last one (0: never).")
    eval_iters: int = _f(1, "Global batches per validation: the valid split's first ones, the same each time.")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training data: Megatron indexed datasets written by `tools/prepare_data.py`."""

    prefix: str | tuple[str, ...] | None = _f(None, "Indexed dataset prefix (PREFIX.bin/.idx/.json); CPT: a list "
                                                    "of prefixes blended by data.weights.")
    weights: tuple[float, ...] | None = _f(None, "Blend weights, one per prefix of a data.prefix list (normalised; "
                                                 "Megatron-Core's BlendedDataset).")
    split: str = _f("100,0,0", "Train/valid/test weights of the documents (SFT: conversations), e.g. 98,2,0: "
                               "consecutive ranges, as Megatron-Core splits; valid feeds train.eval_interval.")
    cache_dir: str | None = _f(None, "CPT: where Megatron-Core's GPTDataset keeps its sample-index caches (null: "
                                     "cache/ beside the first prefix). A folder every node sees, writable when the "
                                     "caches are not built yet: set it when the data's own folder is read-only.")

    @property
    def prefixes(self) -> tuple[str, ...]:
        """data.prefix as a tuple (empty when unset)."""
        return () if self.prefix is None else (self.prefix,) if isinstance(self.prefix, str) else self.prefix


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints and metrics go, and where training starts from."""

    dir: str | None = _f(None, "Output folder: iter_NNNNNNN/, latest_checkpointed_iteration.txt, metrics.jsonl.")
    init_from: str | None = _f(None, "Megatron checkpoint to start from (weights only), e.g. a converted HF model.")
    interval: int = _f(0, "Save every this many steps (0: only at the end).")
    keep_last: int | None = _f(None, "Keep only the newest this many iter_* folders (null: keep all).")
    async_save: bool = _f(False, "Write checkpoints in the background while training goes on (Megatron-Core's "
                                 "async save; the state is staged in host memory). The last one is waited for.")
    tensorboard_dir: str | None = _f(None, "Also write the metrics as TensorBoard event files here (rank 0; needs "
                                           "the tensorboard package; W&B can sync them). null: metrics.jsonl only.")
    fully_parallel_load: bool = _f(
        False, "Spread the reading of a checkpoint (a resume, init_from) over the DP x CP replicas, which then "
        "exchange what they read (Megatron-LM's --ckpt-fully-parallel-load): the file system serves each TP x PP "
        "part once instead of once per replica. Off by default, as in Megatron-LM (not yet measured on a "
        "cluster file system here).")
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = _f(
        "dp_reshardable", "How the distributed optimizer's state is saved. dp_reshardable: each rank writes its flat "
        "buffer slices at once; a resume keeps the state at any DP and CP but not at another TP, PP or gradient "
        "bucket size. fully_reshardable (Megatron-LM's --dist-ckpt-optim-fully-reshardable): the state gathered "
        "over DP x CP into the parameters' own shapes, so any layout resumes it; each save and load then holds "
        "12 bytes per parameter of the rank's TP x PP part in host memory.")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Device and kernels."""

    device: Literal["cuda", "cpu"] = _f("cuda", "cuda (NCCL) or cpu (gloo, CPU backend).")
    attention: Literal["auto", "te", "sdpa"] = _f(
        "auto", "Core attention: te (Transformer Engine), sdpa (torch), auto = te when importable on cuda, except "
        "in fp32 under CP or with SFT's packed sequences before TE 2.11 (TE has no fp32 attention for those)."
    )
    sdpa_kernel: Literal["auto", "flash", "cudnn", "efficient", "math"] = _f(
        "auto", "The torch SDPA kernel of the sdpa attention backend: auto = SDPA's own choice; flash, cudnn, efficient "
        "or math forces one (cudnn and efficient on cuda only). At 128K tokens attention is ~70% of a layer's FLOPs: "
        "bench/sdpa_kernels_bench.py measures each kernel on the GPU to choose. Not with Transformer Engine attention.")
    fp8: Literal["hybrid", "e4m3"] | None = _f(None, "FP8 format for TE linear layers (needs TE and an sm89+ GPU).")
    fp8_attention: bool = _f(False, "FP8 dot-product attention (TE FusedAttention; needs fp8 and an sm90+ GPU; not "
                                    "for SFT's packed sequences; with fp8_recipe tensorwise only on sm100, B200).")
    fp8_recipe: Literal["delayed", "tensorwise"] = _f(
        "delayed", "FP8 scaling: delayed (amax history) or tensorwise (current scaling, TE >= 2.2).")
    timeout_minutes: int = _f(
        30, "How long a collective waits for the slowest rank before the job fails with a timeout instead of "
        "hanging (the default group and Megatron's TP/PP/CP/DP groups). Raise it when a checkpoint save or load on "
        "a slow shared filesystem, or the first step's kernel autotuning on hundreds of GPUs, takes longer.")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """A trace of chosen training steps: where their time goes (attention, recompute, loss, communication)."""

    steps: tuple[int, ...] | None = _f(
        None, "[first, last] training steps to trace (inclusive; leave a step or two of warm-up before them), "
        "e.g. [4, 5]. null: no trace.")
    ranks: tuple[int, ...] = _f((0,), "Global ranks that trace.")
    tool: Literal["torch", "nsys"] = _f(
        "torch", "torch: torch.profiler, a Chrome/Perfetto trace (.pt.trace.json.gz) and a table of the costliest "
        "operators per rank; nsys: the steps as Nsight Systems' capture range (run under `nsys profile "
        "--capture-range=cudaProfilerApi`), one NVTX range per step (cuda only).")
    memory: bool = _f(False, "torch: also record tensor allocations (profile_memory; larger traces).")
    dir: str | None = _f(None, "Where traces go (null: <checkpoint.dir>/profile).")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A whole run. `name` defaults to the file's stem."""

    name: str | None = _f(None, "Run name (defaults to the recipe file name).")
    model: ModelConfig = _f(None, "Architecture.")
    rope: RopeConfig = _f(None, "Rotary embedding.")
    parallel: ParallelConfig = _f(None, "Parallel layout.")
    cluster: ClusterConfig = _f(None, "Target cluster.")
    train: TrainConfig = _f(None, "Optimisation.")
    data: DataConfig = _f(None, "Training data.")
    checkpoint: CheckpointConfig = _f(None, "Checkpoints and metrics.")
    runtime: RuntimeConfig = _f(None, "Device and kernels.")
    profile: ProfileConfig = _f(None, "Tracing chosen training steps.")

    def to_dict(self) -> dict:
        """Plain nested dict (tuples as lists), loadable again as a recipe."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def max_position_embeddings(self) -> int:
        """The model's positions: `model.max_position_embeddings`, or `train.seq_length` when that is null."""
        return self.model.max_position_embeddings or self.train.seq_length

    @property
    def data_parallel_size(self) -> int:
        """DP for the recipe's own cluster size."""
        p = self.parallel
        return self.cluster.nodes * self.cluster.gpus_per_node // (p.tensor * p.pipeline * p.context)


# ---------------------------------------------------------------------------- parsing

_REQUIRED = frozenset({"train.seq_length", "train.steps", "train.lr"})


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected dotted.key=value, e.g. train.steps=10")
    key, value = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise RecipeError(f"override {text!r}: empty key part; expected dotted.key=value, e.g. train.steps=10")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return keys, parsed


def _apply_override(raw: dict, keys: list[str], value: Any) -> None:
    cls, node = Recipe, raw
    for depth, key in enumerate(keys):
        valid = [f.name for f in fields(cls)]
        if key not in valid:
            raise unknown_key(".".join(keys[:depth]), key, valid)
        hint = typing.get_type_hints(cls)[key]
        if depth == len(keys) - 1:
            node[key] = value
            return
        if not dataclasses.is_dataclass(hint):
            raise RecipeError(f"{'.'.join(keys)}: {'.'.join(keys[:depth + 1])} is a value, not a section")
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise bad_value(".".join(keys[: depth + 1]), node, "a mapping")
        cls = hint


# ---------------------------------------------------------------------------- resolution


def load_recipe(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    world_size: int | None = None,
    raw: dict | None = None,
) -> Recipe:
    """Load, merge `extends`, apply dotted overrides, type-check and validate a recipe.

    `world_size` is the number of processes the run will have; defaults to cluster.nodes x gpus_per_node.
    """
    if raw is None:
        if path is None:
            raise RecipeError("no recipe given; pass --recipe FILE (see recipes/)")
        raw = resolve_extends(Path(path))
        raw.setdefault("name", Path(path).stem)
    # the rules and sources import this module's types
    from megatron_ext.recipe_rules import validate
    from megatron_ext.recipe_sources import fill_model, fill_model_rope_fields, fill_rope, fill_rope_preset

    raw = json.loads(json.dumps(raw))  # deep copy, also rejects non-plain YAML values early
    inherited_rope = fill_rope(raw)
    for text in overrides:
        _apply_override(raw, *parse_override(text))
    fill_rope(raw)  # an override `rope=null` / `rope={}`
    fill_rope_preset(raw, inherited_rope)
    fill_model_rope_fields(raw)
    fill_model(raw)
    recipe = build(Recipe, raw, "", _REQUIRED)

    validate(recipe, world_size=world_size)
    return recipe


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `recipe check ... | head` ends quietly, as a Unix filter does
    from megatron_ext.recipe_cli import main

    raise SystemExit(main())
