"""Cross-field rules of a recipe, checked at load before any process group or allocation.

Each rule names the fields involved, the values and what would be valid, in one line.
"""

from __future__ import annotations

import math
from dataclasses import fields

from megatron_ext.presets import PRESETS
from megatron_ext.recipe import Recipe, RecipeError


class WorldSizeError(RecipeError):
    """`parallel.*` does not divide the world size; `fewest`: the fewest processes it fits (data parallel 1)."""

    def __init__(self, message: str, fewest: int):
        super().__init__(message)
        self.fewest = fewest

    def started_alone(self) -> str:
        """The message for a trainer started without a launcher (no torchrun or Slurm variables): its world size is
        1 by default, not by choice, so the fix is the launcher, not parallel.*."""
        return f"{self} (started as 1 process: use torchrun --nproc_per_node={self.fewest} or srun)"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RecipeError(message)


def validate(recipe: Recipe, world_size: int | None = None) -> None:
    """Cross-field rules that need no hardware; raises `RecipeError` on the first violation."""
    m, p, t, r = recipe.model, recipe.parallel, recipe.train, recipe.runtime
    _require(world_size is None or world_size >= 1,
             f"world size = {world_size}: a run has at least 1 process; give --world-size N with N >= 1")
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        source = (f"model.hf_config = {m.hf_config!r} has no {name} in its config.json; set model.{name}"
                  if m.hf_config is not None else
                  f"set it, or set model.preset ({sorted(PRESETS)}) or model.hf_config")
        _require(getattr(m, name) is not None, f"model.{name}: missing required field; {source}")
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"):
        v = getattr(m, name)
        _require(v is None or v >= 1, f"model.{name} = {v}: must be >= 1")
    _require(m.rms_norm_eps > 0, f"model.rms_norm_eps = {m.rms_norm_eps}: must be > 0 (Llama-3.1: 1e-5)")
    for section, obj in (("parallel", p), ("cluster", recipe.cluster)):
        for f in fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, int) and not isinstance(v, bool):
                _require(v >= 1, f"{section}.{f.name} = {v}: must be >= 1")
    for name in ("seq_length", "global_batch_size", "micro_batch_size", "steps", "log_interval", "loss_chunk_tokens"):
        v = getattr(t, name)
        _require(v >= 1, f"train.{name} = {v}: must be >= 1")
    # Megatron-Core sums a step's loss tokens in int32 (schedules.py) and divides the gradients by that sum
    # (finalize_model_grads): past 2^31 - 1 it wraps, and a negative count leaves the gradients unscaled
    _require(t.global_batch_size * t.seq_length < 2**31,
             f"train.global_batch_size x train.seq_length = {t.global_batch_size:,} x {t.seq_length:,} = "
             f"{t.global_batch_size * t.seq_length:,} tokens per step: Megatron-Core counts a step's tokens in int32 "
             f"(at most {2**31 - 1:,}); use fewer sequences per step (the paper's 4M stage: 2)")
    # float("inf") passes every comparison below; the run then diverged at its second step
    for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        v = getattr(t, name)
        _require(math.isfinite(v), f"train.{name} = {v}: must be a finite number")
    _require(t.lr > 0, f"train.lr = {t.lr}: must be > 0")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr = {t.min_lr}: must be between 0 and train.lr = {t.lr}")
    # Optimizer and schedule values the model builder would take as they are: torch's AdamW raises a bare
    # ValueError on some only after the model is built (weight decay, betas), others silently misbehave
    # (negative warmup or clip, a seed numpy refuses at the first random draw).
    _require(t.weight_decay >= 0, f"train.weight_decay = {t.weight_decay}: must be >= 0 (0 = no decay)")
    for name in ("adam_beta1", "adam_beta2"):
        v = getattr(t, name)
        _require(0 <= v < 1, f"train.{name} = {v}: must be in [0, 1) (e.g. 0.9 / 0.95)")
    # 0 would divide 0 by 0 for every weight whose gradient is still exactly 0 (embedding rows of unseen tokens):
    # NaN weights after the first update
    _require(t.adam_eps > 0, f"train.adam_eps = {t.adam_eps}: must be > 0 (e.g. 1e-8)")
    _require(t.clip_grad >= 0, f"train.clip_grad = {t.clip_grad}: must be >= 0 (0 = no clipping)")
    _require(0 <= t.seed < 2**32, f"train.seed = {t.seed}: must be between 0 and 2**32 - 1 = {2**32 - 1}")
    _require(r.timeout_minutes >= 1, f"runtime.timeout_minutes = {r.timeout_minutes}: must be >= 1 (default 30)")
    _require(t.warmup_steps >= 0, f"train.warmup_steps = {t.warmup_steps}: must be >= 0 (0 = no warmup)")
    _require(t.warmup_steps < t.steps or t.warmup_steps == 0,
             f"train.warmup_steps = {t.warmup_steps}: must be below train.steps = {t.steps}")
    if t.recompute_layers is not None:
        stage_layers = m.num_hidden_layers // p.pipeline
        _require(t.recompute == "full",
                 f"train.recompute_layers = {t.recompute_layers}: needs train.recompute = 'full' "
                 f"(is {t.recompute!r}); set train.recompute=full or train.recompute_layers=null")
        _require(1 <= t.recompute_layers <= stage_layers,
                 f"train.recompute_layers = {t.recompute_layers}: must be between 1 and the layers of a pipeline "
                 f"stage ({stage_layers} = model.num_hidden_layers / parallel.pipeline)")
    _require(not t.overlap_param_gather or (t.distributed_optimizer and t.overlap_grad_reduce),
             "train.overlap_param_gather = true: needs train.distributed_optimizer=true and "
             "train.overlap_grad_reduce=true (Megatron-Core gathers the parameters the distributed optimizer updated)")
    _require(t.ddp_bucket_size is None or (t.overlap_grad_reduce and t.ddp_bucket_size >= 1),
             f"train.ddp_bucket_size = {t.ddp_bucket_size}: " + (
                 "must be >= 1 parameters" if t.overlap_grad_reduce else
                 "has an effect only with train.overlap_grad_reduce=true (without it all gradients form one bucket)"))
    _require(recipe.checkpoint.optimizer_sharding == "dp_reshardable" or t.distributed_optimizer,
             "checkpoint.optimizer_sharding = 'fully_reshardable': only the distributed optimizer's state has a "
             "choice (train.distributed_optimizer = false: its state already loads at any layout); remove the field")
    _require(recipe.checkpoint.interval >= 0, f"checkpoint.interval = {recipe.checkpoint.interval}: must be >= 0 (0 = at end)")
    keep = recipe.checkpoint.keep_last
    # 0 would keep every checkpoint (`if keep_last:`) and -1 only the newest (`[:-(-1)]`): neither is what it says.
    _require(keep is None or keep >= 1,
             f"checkpoint.keep_last = {keep}: must be a positive number of checkpoints, or null to keep all")
    _validate_data(recipe)

    heads = m.num_attention_heads
    kv_heads = m.num_key_value_heads or heads
    _require(heads % kv_heads == 0,
             f"model.num_key_value_heads = {kv_heads}: must divide model.num_attention_heads = {heads}")
    _require(m.head_dim is not None or m.hidden_size % heads == 0,
             f"model.hidden_size = {m.hidden_size}: not divisible by num_attention_heads = {heads}; set model.head_dim")

    model_parallel = p.tensor * p.pipeline * p.context
    world = world_size if world_size is not None else recipe.cluster.nodes * recipe.cluster.gpus_per_node
    source = "the world size" if world_size is not None else "cluster.nodes x cluster.gpus_per_node"
    if world % model_parallel:
        raise WorldSizeError(f"parallel: tensor x pipeline x context = {p.tensor} x {p.pipeline} x {p.context} = "
                             f"{model_parallel} does not divide {source} = {world}; change parallel.* or the number of "
                             "processes", model_parallel)
    dp = world // model_parallel
    _require(heads % p.tensor == 0,
             f"parallel.tensor = {p.tensor}: must divide model.num_attention_heads = {heads}")
    _require(kv_heads % p.tensor == 0,
             f"parallel.tensor = {p.tensor}: must divide model.num_key_value_heads = {kv_heads} "
             f"(each TP rank needs whole KV heads); use tensor <= {kv_heads} dividing it")
    _require(m.num_hidden_layers % p.pipeline == 0,
             f"parallel.pipeline = {p.pipeline}: must divide model.num_hidden_layers = {m.num_hidden_layers}")
    _require(m.intermediate_size % p.tensor == 0,
             f"parallel.tensor = {p.tensor}: must divide model.intermediate_size = {m.intermediate_size} "
             "(each TP rank holds an equal slice of the MLP)")
    if p.context > 1:
        _require(t.seq_length % (2 * p.context) == 0,
                 f"train.seq_length = {t.seq_length}: must be divisible by 2 x parallel.context = {2 * p.context} "
                 f"(causal load balancing splits each sequence into 2 x CP chunks); "
                 f"e.g. {-(-t.seq_length // (2 * p.context)) * 2 * p.context}")
    if p.cp_comm_type == "a2a" and p.context > 1:
        for label, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            _require((n // p.tensor) % p.context == 0,
                     f"parallel.cp_comm_type = 'a2a': model.{label} per TP rank = {n // p.tensor} must be divisible "
                     f"by parallel.context = {p.context}; use cp_comm_type p2p, or a2a+p2p with an a2a size "
                     "(parallel.hierarchical_context_sizes[0]) that divides it")
    _require(p.hierarchical_context_sizes is None or p.cp_comm_type == "a2a+p2p",
             f"parallel.hierarchical_context_sizes = {list(p.hierarchical_context_sizes or ())}: used only with "
             f"cp_comm_type 'a2a+p2p' (is {p.cp_comm_type!r}); remove it or set parallel.cp_comm_type=a2a+p2p")
    if p.cp_comm_type == "a2a+p2p":
        sizes = p.hierarchical_context_sizes
        _require(sizes is not None and len(sizes) == 2 and sizes[0] * sizes[1] == p.context,
                 f"parallel.hierarchical_context_sizes = {list(sizes) if sizes else None}: cp_comm_type 'a2a+p2p' "
                 f"needs [a2a size, p2p size] with product parallel.context = {p.context}")
        for label, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            # TE's all-to-all splits each TP rank's heads over the a2a group
            _require((n // p.tensor) % sizes[0] == 0,
                     f"parallel.hierarchical_context_sizes = {list(sizes)}: the a2a size {sizes[0]} must divide "
                     f"model.{label} per TP rank = {n // p.tensor}; use a smaller a2a size or cp_comm_type p2p")
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size = {t.global_batch_size}: must be divisible by micro_batch_size x data parallel "
             f"= {t.micro_batch_size} x {dp} = {per_step}")
    if r.device == "cpu":
        _require(r.fp8 is None, f"runtime.fp8 = {r.fp8!r}: FP8 needs Transformer Engine on an sm89+ GPU; "
                                "set runtime.fp8=null for runtime.device=cpu")
        _require(r.attention != "te", "runtime.attention = 'te': Transformer Engine needs runtime.device=cuda; use sdpa")
        _require(r.sdpa_kernel in ("auto", "flash", "math"),
                 f"runtime.sdpa_kernel = {r.sdpa_kernel!r}: torch has no such kernel on the CPU; use auto, flash or "
                 "math for runtime.device=cpu")
        _require(not p.sequence_parallel,
                 "parallel.sequence_parallel = true: needs Transformer Engine norms (runtime.device=cuda)")
    _require(not (p.sequence_parallel and r.attention == "sdpa"),
             "parallel.sequence_parallel = true with runtime.attention = 'sdpa': sequence parallelism needs the "
             "Transformer Engine path (Megatron's torch norms refuse it); use runtime.attention=auto or te, or "
             "parallel.sequence_parallel=false")
    _require(not (r.attention == "te" and r.device == "cuda" and t.precision == "fp32" and p.context > 1),
             f"runtime.attention = 'te' with train.precision = 'fp32' and parallel.context = {p.context}: Transformer "
             "Engine attends fp32 only in its unfused backend, which takes no context parallelism; use "
             "train.precision=bf16, or runtime.attention=sdpa (auto chooses it here)")
    _require(not r.fp8_attention or r.fp8 is not None,
             "runtime.fp8_attention = true: needs runtime.fp8 (hybrid or e4m3)")
    _require(not (r.fp8_attention and p.context > 1 and p.cp_comm_type in ("all_gather", "a2a+p2p")),
             f"runtime.fp8_attention with parallel.cp_comm_type = {p.cp_comm_type!r}: TE supports FP8 attention "
             "under CP only with p2p or a2a")
    # TE's FP8 attention (cuDNN FusedAttention; FP8 turns its flash and unfused backends off) takes BSHD/SBHD
    # sequences only, and with current scaling only on sm100: otherwise no backend is left at the first forward.
    _require(not (r.fp8_attention and t.stage == "sft"),
             "runtime.fp8_attention = true with train.stage = 'sft': TE's FP8 attention does not take SFT's packed "
             "(THD) sequences; set runtime.fp8_attention=false (runtime.fp8 still runs the linear layers in FP8)")
    sm90 = recipe.cluster.gpu in ("h100-80gb", "h200-141gb")  # unnamed: the build checks the device (model.py)
    _require(not (r.fp8_attention and r.fp8_recipe == "tensorwise" and sm90),
             f"runtime.fp8_attention = true with runtime.fp8_recipe = 'tensorwise' on cluster.gpu = {recipe.cluster.gpu!r}: "
             "TE runs FP8 attention with current scaling only on sm100 GPUs (B200); on H100/H200 use "
             "runtime.fp8_recipe=delayed")
    _require(r.sdpa_kernel == "auto" or r.attention == "sdpa" or r.device == "cpu",
             f"runtime.sdpa_kernel = {r.sdpa_kernel!r} chooses the kernel of the torch SDPA backend, but "
             f"runtime.attention = {r.attention!r} (Transformer Engine's attention where it imports); set "
             "runtime.attention=sdpa, or runtime.sdpa_kernel=auto")
    # Under CP each chunk attends with a lower-right causal bias, which flash takes as its causal flag; a kernel
    # without that alignment gets a dense [chunk, keys] mask from torch (~137 GB per chunk at 1M tokens, CP 4).
    _require(r.sdpa_kernel in ("auto", "flash") or p.context == 1,
             f"runtime.sdpa_kernel = {r.sdpa_kernel!r} with parallel.context = {p.context}: the sdpa backend's CP "
             "chunks attend with a lower-right causal bias, which only the flash kernel runs without a dense mask "
             "of chunk x keys; use runtime.sdpa_kernel=flash or auto under CP")
    _require(not (r.fp8 is not None and r.attention == "sdpa"),
             "runtime.fp8 with runtime.attention = 'sdpa': FP8 needs the Transformer Engine path (attention te/auto)")
    _require(not p.sequence_parallel or p.tensor > 1, "parallel.sequence_parallel = true: needs parallel.tensor > 1")
    if p.sequence_parallel:
        local = t.seq_length // p.context
        _require(local % p.tensor == 0,
                 f"train.seq_length = {t.seq_length}: with parallel.sequence_parallel each rank's {local} tokens "
                 f"(seq_length / context) are split over parallel.tensor = {p.tensor} ranks and must divide evenly; "
                 f"e.g. train.seq_length = {-(-t.seq_length // (p.tensor * 2 * p.context)) * p.tensor * 2 * p.context}")
    if t.stage == "sft":
        _require(t.micro_batch_size == 1,
                 f"train.micro_batch_size = {t.micro_batch_size}: SFT runs one packed sequence per microbatch "
                 "(THD); use micro_batch_size=1 and raise train.global_batch_size instead")
        # Packs are not split over CP ranks (each conversation padded to 2 x CP chunks, as TE's THD attention and
        # Megatron's THD RoPE under CP expect): every CP rank would read the whole pack.
        _require(p.context == 1,
                 f"parallel.context = {p.context} with train.stage = 'sft': packed SFT sequences are not split for "
                 "context parallelism; SFT samples are short (8K), use parallel.context=1")
    _validate_rope_block(recipe)
    _validate_profile(recipe, world if world_size is not None else None)


def _validate_profile(recipe: Recipe, world_size: int | None) -> None:
    """profile.steps is a range of the run's steps; nsys needs CUDA; the tracing ranks exist."""
    pr, steps = recipe.profile, recipe.train.steps
    if pr.steps is not None:
        first, last = (pr.steps + (0, 0))[:2]
        _require(len(pr.steps) == 2 and 1 <= first <= last <= steps,
                 f"profile.steps = {list(pr.steps)}: expected [first, last] with 1 <= first <= last <= train.steps "
                 f"= {steps}, e.g. profile.steps=[{min(3, steps)},{min(4, steps)}] (a warm-up step or two first)")
    _require(pr.tool != "nsys" or recipe.runtime.device == "cuda",
             "profile.tool = 'nsys': Nsight Systems traces CUDA; use profile.tool=torch for runtime.device=cpu")
    _require(len(pr.ranks) >= 1 and all(r >= 0 for r in pr.ranks),
             f"profile.ranks = {list(pr.ranks)}: expected a list of global ranks >= 0, e.g. [0]")
    if world_size is not None:
        _require(all(r < world_size for r in pr.ranks),
                 f"profile.ranks = {list(pr.ranks)}: the run has ranks 0..{world_size - 1}")


def _validate_data(recipe: Recipe) -> None:
    """data.prefix / data.weights describe one dataset or a CPT blend; data.split parses, and validation has a
    valid split to read."""
    from megatron_ext.data.common import DataError, split_fractions

    t, d = recipe.train, recipe.data
    if isinstance(d.prefix, tuple):
        _require(len(d.prefix) >= 1, "data.prefix = []: give a dataset prefix, or a list of them with data.weights")
        _require(len(d.prefix) == 1 or t.stage == "cpt",
                 f"data.prefix: a list of {len(d.prefix)} prefixes with train.stage = 'sft'; SFT reads one dataset "
                 "(prepare the conversations together with tools/prepare_data.py sft)")
        _require(len(d.prefix) == 1 or d.weights is not None,
                 f"data.prefix: a list of {len(d.prefix)} prefixes needs data.weights, one per prefix "
                 f"(e.g. data.weights=[{', '.join(['1'] * len(d.prefix))}])")
    if d.weights is not None:
        _require(len(d.weights) == len(d.prefixes),
                 f"data.weights = {list(d.weights)}: {len(d.weights)} weights for {len(d.prefixes)} prefixes in "
                 "data.prefix; give one per prefix")
        _require(all(w > 0 for w in d.weights), f"data.weights = {list(d.weights)}: every weight must be > 0")
    try:
        valid = split_fractions(d.split)[1]
    except DataError as e:
        raise RecipeError(str(e)) from None
    _require(t.eval_interval >= 0, f"train.eval_interval = {t.eval_interval}: must be >= 0 (0 = no validation)")
    _require(t.eval_iters >= 1, f"train.eval_iters = {t.eval_iters}: must be >= 1")
    _require(t.eval_interval == 0 or valid > 0,
             f"train.eval_interval = {t.eval_interval}: data.split = {d.split!r} holds no documents out "
             "for validation; give the valid split a weight (e.g. data.split=98,2,0) or set train.eval_interval=0")


def _validate_rope_block(recipe: Recipe) -> None:
    """The full rope check the model builder will run (megatron_ext.rope_spec), at load time."""
    from megatron_ext.rope_spec import ROPE_FIELDS, rope_spec

    r, m = recipe.rope, recipe.model
    block = {"rope_type": r.rope_type, "rope_theta": r.rope_theta, "partial_rotary_factor": r.partial_rotary_factor}
    for key in ROPE_FIELDS[r.rope_type]:
        value = getattr(r, key)
        if value is not None:
            block[key] = list(value) if isinstance(value, tuple) else value
    rope_spec({"rope_parameters": block, "head_dim": m.head_dim, "hidden_size": m.hidden_size,
               "num_attention_heads": m.num_attention_heads,
               "max_position_embeddings": recipe.max_position_embeddings},
              where="rope", top="model")
