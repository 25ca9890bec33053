"""The plan of a recipe on a GPU cluster: does it fit, how long does a step take, which CP to use?

Composes the formulas of `megatron_ext.cost_model` (perf.md sections 5-6) for a recipe's architecture and
TP/PP/CP/DP layout, recompute and loss head.

    p = plan(load_recipe("recipes/cpt_4m.yaml"), GPUS["h100-80gb"], mfu=0.35)
    p.memory.total / GB, p.fits, p.timing.hours
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.checkpoint_index import gradient_bucket_size
from megatron_ext.cost_model import (
    GB,
    GPU,
    GRAD_BYTES,
    OVERHEAD_BYTES,
    RECOMPUTE_MODES,
    Memory,
    Shape,
    activation_bytes,
    cp_buffer_bytes,
    loss_head_bytes,
    model_state_bytes,
    padded_vocab,
    params_per_gpu,
    rope_table_bytes,
    sp_buffer_bytes,
    train_flops_per_token,
)
from megatron_ext.recipe import Recipe, RecipeError
from megatron_ext.recipe_rules import validate

TIGHT_FRACTION = 0.9  # above this share of capacity a fit is flagged "tight" (perf.md §6 headroom judgement)
# Wall clock of the paper's CPT runs on 256 x H100 ([S2], UNCONFIRMED; paper.md §3, perf.md §2):
# recipe name -> (hours, sequence length).
PAPER_HOURS = {"cpt_1m": (5.0, 1 << 20), "cpt_2m": (6.0, 1 << 21), "cpt_4m": (13.0, 1 << 22)}


# ---------------------------------------------------------------------------- time per step


@dataclass(frozen=True)
class Timing:
    """One optimizer step of the whole cluster."""

    flops_per_token: float  # model FLOPs (causal), perf.md §5a
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float  # exposed part only: the p2p ring overlaps with attention
    dp_comm_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # achieved model FLOPs / peak, after recompute and communication
    hours: float  # for the recipe's train.steps, validations included
    validation_s: float = 0.0  # one validation (train.eval_iters global batches, forward only)
    validations: int = 0  # how many the run does (train.eval_interval)


def _link(group_span: int, gpus_per_node: int, gpu: GPU) -> float:
    return gpu.nvlink_bw if group_span <= gpus_per_node else gpu.network_bw


# ---------------------------------------------------------------------------- plan of a recipe


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    gpu: GPU
    gpus: int
    tensor: int
    pipeline: int
    context: int
    data: int
    recompute: str
    recompute_layers: int | None  # full only: the first N layers of each stage; None: all
    fused_ce: bool
    memory: Memory
    timing: Timing

    @property
    def recompute_label(self) -> str:
        if self.recompute == "full" and self.recompute_layers is not None:
            return f"full ({self.recompute_layers} of {self.recipe.model.num_hidden_layers // self.pipeline} layers)"
        return self.recompute

    @property
    def recompute_overrides(self) -> str:
        """The recipe overrides that select this plan's recompute."""
        return f"train.recompute={self.recompute}" + (
            f" train.recompute_layers={self.recompute_layers}" if self.recompute_layers is not None else "")

    @property
    def capacity(self) -> float:
        return self.gpu.memory_gb * GB

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def tight(self) -> bool:
        return self.fits and self.memory.total > TIGHT_FRACTION * self.capacity


def kernels_of(recipe: Recipe) -> str:
    """te on GPUs with Transformer Engine (the paper's setting), local for CPU / torch SDPA."""
    rt = recipe.runtime
    return "local" if rt.device == "cpu" or rt.attention == "sdpa" else "te"


def plan(recipe: Recipe, gpu: GPU, gpus: int | None = None, mfu: float = 0.35, *, context: int | None = None,
         recompute: str | None = None, recompute_layers: int | None = None, fused_ce: bool = False) -> Plan:
    """Memory and time of `recipe` on `gpus` x `gpu`; `context`/`recompute` override the recipe's
    (`recompute` with `recompute_layers`, the first N layers of each stage for `full`).

    `fused_ce` assumes a fused cross entropy (2 B x V/TP per token) where the recipe's loss head is `full`.

    `mfu`: fraction of BF16 peak the kernels sustain on the FLOPs they execute; recomputation adds
    its FLOPs at that rate, so the achieved MFU reported is lower. Raises RecipeError for layouts
    that do not divide the GPUs, the sequence or the global batch.
    """
    if not 0 < mfu <= 1:
        raise RecipeError(f"--mfu = {mfu}: must be in (0, 1], e.g. 0.35")
    gpus = gpus or recipe.cluster.nodes * recipe.cluster.gpus_per_node
    changed = dataclasses.replace(
        recipe, parallel=dataclasses.replace(recipe.parallel, context=context or recipe.parallel.context),
        train=recipe.train if recompute is None else dataclasses.replace(
            recipe.train, recompute=recompute, recompute_layers=recompute_layers))
    validate(changed, world_size=gpus)
    recipe = changed
    s, p, t = Shape.from_recipe(recipe), recipe.parallel, recipe.train
    tp, pp, cp = p.tensor, p.pipeline, p.context
    dp = gpus // (tp * pp * cp)
    dtype = 2.0 if t.precision == "bf16" else 4.0
    sp = p.sequence_parallel
    rows = padded_vocab(s.vocab, recipe.model.make_vocab_size_divisible_by, tp)
    tokens = t.seq_length // cp * t.micro_batch_size  # per GPU per micro-batch
    microbatches = t.global_batch_size // (dp * t.micro_batch_size)
    states = model_state_bytes(params_per_gpu(s, tp, pp, rows), dp * cp, t.precision, t.distributed_optimizer)
    kernels = kernels_of(recipe)
    mem = Memory(
        **states,
        activations=activation_bytes(s, tokens, s.layers // pp, t.recompute, tp, sp, dtype, kernels,
                                     in_flight=min(pp, microbatches), recompute_layers=t.recompute_layers,
                                     unfused_rope=True, context=cp),
        logits=loss_head_bytes(s, tokens, rows, tp, sp, dtype, t.loss_head, t.loss_chunk_tokens, fused_ce),
        rope=rope_table_bytes(t.seq_length, cp, s.head_dim),
        cp_buffers=cp_buffer_bytes(s, tokens, tp, cp, dtype, kernels),
        sp_buffers=sp_buffer_bytes(s, tokens, tp, sp, dtype),
        overhead=OVERHEAD_BYTES if recipe.runtime.device == "cuda" else 0.0,
    )
    return Plan(recipe, gpu, gpus, tp, pp, cp, dp, t.recompute, t.recompute_layers, fused_ce, mem,
                step_timing(recipe, s, gpu, gpus, dp, mfu))


def step_timing(recipe: Recipe, s: Shape, gpu: GPU, gpus: int, dp: int, mfu: float) -> Timing:
    """Compute (hardware FLOPs over peak x mfu) plus communication that the algorithm does not hide."""
    p, t = recipe.parallel, recipe.train
    tp, pp, cp = p.tensor, p.pipeline, p.context
    dtype = 2.0 if t.precision == "bf16" else 4.0
    rate = gpu.bf16_tflops * 1e12 * mfu
    f_tok = train_flops_per_token(s, t.seq_length)
    d_attn = s.heads * s.head_dim
    attn_fwd_tok = 2 * s.layers * d_attn * (t.seq_length + 1)  # forward attention core, per token
    # the share of layers whose forward runs again (full: all, or the first recompute_layers of a stage)
    recomputed = 0.0 if t.recompute != "full" else (
        1.0 if t.recompute_layers is None else t.recompute_layers / (s.layers // pp))
    extra = {"none": 0.0, "selective": attn_fwd_tok, "full": recomputed * f_tok / 3}[t.recompute]
    if t.loss_head == "chunked":
        extra += 2 * s.hidden * s.vocab  # its backward forms the logits again (megatron_ext/loss_head.py)
    tokens_step = t.global_batch_size * t.seq_length
    microbatches = t.global_batch_size // (dp * t.micro_batch_size)
    bubble = 1 + (pp - 1) / microbatches  # 1F1B pipeline bubble
    compute = tokens_step * (f_tok + extra) / gpus / rate * bubble
    tokens_mb = t.seq_length // cp * t.micro_batch_size  # per GPU per micro-batch
    # TP with SP: per layer 4 collectives forward (all-gather before QKV and FC1, reduce-scatter after
    # O and FC2), 6 backward (their transposes + re-gathering the inputs for the weight gradients),
    # +4 when the forward is recomputed; each moves (tp-1)/tp of [tokens, hidden]; not overlapped.
    collectives = 10 + 4 * recomputed
    collective_s = (s.layers / pp * (tp - 1) / tp * tokens_mb * s.hidden * dtype
                    / _link(tp, recipe.cluster.gpus_per_node, gpu)) if tp > 1 else 0.0  # one per layer
    tp_comm = microbatches * collectives * collective_s
    # CP p2p ring: cp-1 steps per layer, each sends the local K/V (backward: K/V and dK/dV) while
    # attention of one chunk pair (1/cp of the layer's attention) computes; only the excess shows.
    cp_comm = fwd = 0.0
    if cp > 1:
        link = _link(tp * cp, recipe.cluster.gpus_per_node, gpu)
        kv = tokens_mb * 2 * s.kv_heads * s.head_dim / tp * dtype
        attn_layer = tokens_mb * attn_fwd_tok / s.layers / tp / rate  # forward attention of one layer
        fwd = max(0.0, kv / link - attn_layer / cp)
        bwd = max(0.0, 2 * kv / link - 2 * attn_layer / cp)
        passes = 1 + recomputed
        cp_comm = microbatches * s.layers / pp * (cp - 1) * (passes * fwd + bwd)
    # DP x CP: the distributed optimizer reduce-scatters the fp32 gradients and all-gathers the parameters once
    # per step. train.overlap_grad_reduce runs the reduce-scatter bucket by bucket under the last microbatch's
    # backward (about 2/3 of its compute), train.overlap_param_gather the all-gather under the next forward's
    # first microbatch (1/3); what exceeds that compute shows, and at least the bucket that is ready last.
    shards = dp * cp
    dp_comm = 0.0
    if shards > 1:
        params = params_per_gpu(s, tp, pp, padded_vocab(s.vocab, recipe.model.make_vocab_size_divisible_by, tp))
        link = _link(gpus // pp, recipe.cluster.gpus_per_node, gpu)
        reduce_s = (shards - 1) / shards * params * GRAD_BYTES / link
        gather_s = (shards - 1) / shards * params * dtype / link
        bucket = gradient_bucket_size(t.overlap_grad_reduce, t.ddp_bucket_size, dp)
        last = 1.0 if bucket is None else min(1.0, bucket / params)
        microbatch_s = compute / bubble / microbatches
        if t.overlap_grad_reduce:
            reduce_s = max(last * reduce_s, reduce_s - microbatch_s * 2 / 3)
        if t.overlap_param_gather:
            gather_s = max(last * gather_s, gather_s - microbatch_s / 3)
        dp_comm = reduce_s + gather_s
    step = compute + tp_comm + cp_comm + dp_comm
    tok_s_gpu = tokens_step / step / gpus
    # Validation: the forward third of the model FLOPs (perf.md §1: 2N of 6N per token), no recompute and no
    # loss-head backward, the 4 forward TP collectives and the forward CP exchange, no optimizer step.
    batch_s = (tokens_step * f_tok / 3 / gpus / rate * bubble
               + microbatches * (4 * collective_s + s.layers / pp * (cp - 1) * fwd))
    validation_s = t.eval_iters * batch_s if t.eval_interval else 0.0
    validations = len({*range(t.eval_interval, t.steps + 1, t.eval_interval), t.steps}) if t.eval_interval else 0
    return Timing(f_tok, compute, tp_comm, cp_comm, dp_comm, step, tok_s_gpu,
                  tok_s_gpu * f_tok / (gpu.bf16_tflops * 1e12), (step * t.steps + validations * validation_s) / 3600,
                  validation_s, validations)


def context_candidates(recipe: Recipe, gpus: int) -> list[int]:
    """CP sizes the GPU count and sequence allow with the recipe's TP and PP, ascending (SFT: CP 1 only, its
    packs are not split over CP ranks)."""
    p = recipe.parallel
    free = gpus // (p.tensor * p.pipeline) if gpus % (p.tensor * p.pipeline) == 0 else 0
    if recipe.train.stage == "sft":
        free = min(free, 1)
    return [c for c in range(1, free + 1) if free % c == 0 and (c == 1 or recipe.train.seq_length % (2 * c) == 0)]


def _memory_only(recipe: Recipe, gpu: GPU, gpus: int, cp: int, recompute: str, fused_ce: bool) -> Plan | None:
    """Plan at CP `cp`, ignoring the global batch's divisibility (None if the layout is impossible). With one
    microbatch per pipeline stage in flight at least (PP of them: 1F1B's warm-up): one in all undercounted the
    activations of a pipeline by PP times."""
    p = recipe.parallel
    dp = gpus // (p.tensor * p.pipeline * cp)
    train = dataclasses.replace(recipe.train, global_batch_size=dp * recipe.train.micro_batch_size * p.pipeline)
    try:
        return plan(dataclasses.replace(recipe, train=train), gpu, gpus, context=cp, recompute=recompute,
                    fused_ce=fused_ce)
    except RecipeError:
        return None


def min_context(recipe: Recipe, gpu: GPU, gpus: int | None = None, recompute: str | None = None,
                fused_ce: bool = False) -> int | None:
    """Smallest CP whose memory fits `gpu` (other layout fields as in the recipe); None if none does."""
    gpus = gpus or recipe.cluster.nodes * recipe.cluster.gpus_per_node
    for cp in context_candidates(recipe, gpus):
        p = _memory_only(recipe, gpu, gpus, cp, recompute or recipe.train.recompute, fused_ce)
        if p is not None and p.fits:
            return cp
    return None


def recommend(recipe: Recipe, gpu: GPU, gpus: int | None = None, mfu: float = 0.35,
              fused_ce: bool = False) -> Plan | None:
    """Fastest (CP, recompute) that fits and keeps the recipe's global batch; None if none does.

    Full recompute is tried on the fewest first layers of a stage that fit with 10% of the memory
    to spare (`train.recompute_layers`), since every layer left out saves its forward again. A plan
    above 90% of the memory (`Plan.tight`) is chosen only when none below fits.
    """
    gpus = gpus or recipe.cluster.nodes * recipe.cluster.gpus_per_node
    stage_layers = recipe.model.num_hidden_layers // recipe.parallel.pipeline
    best: dict[bool, Plan | None] = {False: None, True: None}  # the fastest plan, by tightness
    for recompute in RECOMPUTE_MODES:
        # fewest recomputed layers first (the fastest), then all of them
        options = [*range(1, stage_layers), None] if recompute == "full" else [None]
        for cp in context_candidates(recipe, gpus):
            for layers in options:  # memory grows as fewer layers are recomputed: the first fit is the fastest
                try:
                    p = plan(recipe, gpu, gpus, mfu, context=cp, recompute=recompute, recompute_layers=layers,
                             fused_ce=fused_ce)
                except RecipeError:
                    p = None
                    break
                if p.fits and (layers is None or not p.tight):  # partial recompute keeps the 10% headroom
                    break
            if p is not None and p.fits:
                other = best[p.tight]
                if other is None or p.timing.step_s < other.timing.step_s * 0.999:
                    best[p.tight] = p
    return best[False] or best[True]
