"""The plan of an evaluation on the Megatron engine: memory per GPU, time of a prompt, and of a NIAH grid.

`tools/niah.py --engine megatron` (NIAH, perplexity, generate) runs one prompt at a time per data-parallel replica
through Megatron's forward-only schedule, split TP x PP x CP, and keeps the prompt's KV cache on the ranks
(`megatron_ext.evaluate.parallel`, `kv_cache`). Per GPU that needs the weights, the cache and the working set of
one layer on the rank's share of the tokens; a prompt costs one prefill (forward FLOPs, causal count) and then a
decode step per further token (reading the rank's weights and cache once). Pipeline stages run one after another
on a single prompt, so PP divides memory but not time; replicas (DP) take prompts in parallel.

    p = eval_plan(Shape.from_recipe(recipe), GPUS["h100-80gb"], 1 << 22, gpus=64, tensor=8, context=8)
    p.memory.total / GB, p.fits, p.prefill_s
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.cost_model import (
    GB,
    GPU,
    OVERHEAD_BYTES,
    Shape,
    gathered_kv_bytes,
    kv_cache_bytes_per_token,
    layer_matmul_params,
    params_per_gpu,
)
from megatron_ext.recipe import RecipeError


@dataclass(frozen=True)
class EvalMemory:
    """Peak bytes on the busiest GPU of the engine."""

    weights: float
    kv_cache: float
    activations: float  # one layer's working set on the rank's tokens, incl. gathered K/V
    rope: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))


@dataclass(frozen=True)
class EvalPlan:
    """The engine on one prompt length: layout, memory per GPU and times."""

    gpu: GPU
    gpus: int
    length: int
    tensor: int
    pipeline: int
    context: int
    data: int
    memory: EvalMemory
    prefill_flops: float
    prefill_s: float  # one prompt, at `mfu`
    decode_step_s: float  # lower bound: the stages' weights and cache read once at HBM bandwidth

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu.memory_gb * GB

    def grid_hours(self, prompts: int, new_tokens: int = 0) -> float:
        """Hours for `prompts` prompts of this length over the DP replicas, `new_tokens` decode steps each, every
        prompt a full prefill (an upper bound where prompts share a prefix)."""
        rounds = -(-prompts // self.data)
        return rounds * (self.prefill_s + new_tokens * self.decode_step_s) / 3600

    def niah_hours(self, s: Shape, depths: int, new_tokens: int = 0) -> float:
        """Hours for a NIAH grid's `depths` prompts of this length (needle depths evenly spread over 0-100%) with the
        engine's shared prefixes (`niah_pass_flops`), over the DP replicas, `new_tokens` decode steps each."""
        per_flop = self.prefill_s / self.prefill_flops
        replicas = [niah_pass_flops(s, self.length, depths, first=r, step=self.data) for r in range(self.data)]
        rounds = -(-depths // self.data)
        return (max(replicas) * per_flop + rounds * new_tokens * self.decode_step_s) / 3600


def prefill_flops(s: Shape, length: int) -> float:
    """Forward FLOPs of a `length`-token prompt without the output layer (only a few rows meet it): 2 N_matmul per
    token plus causal attention, 2 x d_attn x (L + 1) per token and layer (a third of `train_flops_per_token`)."""
    attention = s.layers * 2.0 * s.heads * s.head_dim * (length + 1)
    return length * (2.0 * s.layers * layer_matmul_params(s) + attention)


# Both evaluation engines run a prompt after the cached one's shared prefix only when that prefix is at least this
# share of the prompt: a shorter one (a chat template's head) saves too little to run a pass other than the prefill
# (the Megatron engine's extensions attend with torch SDPA in the model's dtype, its prefill with TE, FP8).
MIN_SHARED_PREFIX = 0.125


def niah_pass_flops(s: Shape, length: int, depths: int, *, first: int = 0, step: int = 1,
                    min_shared: float = MIN_SHARED_PREFIX) -> float:
    """Forward FLOPs of the passes over a NIAH grid's prompts of `length` tokens whose needles sit at `depths`
    depths evenly spread over 0-100%, as the Megatron engine runs them (`parallel.MegatronGreedy`): by depth,
    keeping the KV cache, so that a prompt runs only its positions after the haystack it shares with the one its
    replica ran before (the earlier needle's depth; the instruction before the haystack is neglected), or all of
    them where that is under `min_shared` of the prompt. A replica runs prompts `first`, `first + step`, ... (DP
    replicas share them). Positions c .. L - 1 cost prefill_flops(L) - prefill_flops(c): exact for the causal count.
    """
    if depths < 1 or not 0 <= first < step:
        raise ValueError(f"depths = {depths}, first = {first}, step = {step}: need depths >= 1, 0 <= first < step")
    full = prefill_flops(s, length)
    total, before = 0.0, None
    for i in range(first, depths, step):
        shared = 0 if before is None else round(before / max(depths - 1, 1) * length)
        total += full - (prefill_flops(s, shared) if shared >= min_shared * length else 0.0)
        before = i
    return total


def layer_working_set_bytes(s: Shape, length: int, tensor: int, context: int, dtype_bytes: float = 2.0,
                            kernels: str = "te") -> float:
    """Peak live bytes of one layer's forward on a rank's `length / context` tokens (nothing kept for backward).

    The larger of two phases. MLP: the residual stream in and out, the norm output and the FC2 output (4h), FC1's
    2 ffn and the activation's ffn on this TP rank (te: fused SwiGLU), plus the two GLU temporaries of Megatron's
    local MLP (local: 5 ffn, as measured on CPU, tests/unit/test_eval_plan.py). Attention: residual, norm output
    and projection output (3h), Q/K/V, rotated Q and K, the core output on this TP rank, and K/V of the whole
    sequence when the torch SDPA backend all-gathers them (local, CP > 1; TE's p2p ring holds two chunks).
    """
    if kernels not in ("te", "local"):
        raise ValueError(f"kernels = {kernels!r}: expected 'te' or 'local'")
    tokens = length / context
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim / tensor
    rotated = (s.heads + s.kv_heads) * s.head_dim / tensor
    ring = gathered_kv_bytes(s, length if kernels == "local" else 2 * tokens, tensor, dtype_bytes) if context > 1 else 0.0
    attention = tokens * dtype_bytes * (3 * s.hidden + qkv + rotated + s.heads * s.head_dim / tensor) + ring
    mlp = tokens * dtype_bytes * (4 * s.hidden + (5 if kernels == "local" else 3) * s.ffn / tensor)
    return max(attention, mlp)


def eval_plan(s: Shape, gpu: GPU, length: int, *, gpus: int, tensor: int = 1, pipeline: int = 1, context: int = 1,
              vocab_rows: int | None = None, mfu: float = 0.35, hbm_bandwidth: float | None = None,
              kernels: str = "te", dtype_bytes: float = 2.0) -> EvalPlan:
    """Memory and time of the Megatron engine on a `length`-token prompt over `gpus` x `gpu` at TP x PP x CP.

    `kernels`: te (Transformer Engine, the paper's setting) or local (torch SDPA backend, Megatron's local spec).
    `hbm_bandwidth` (bytes/s, default the GPU's) bounds the decode step. Raises RecipeError for a layout that does
    not divide the GPUs or the heads.
    """
    if min(tensor, pipeline, context) < 1 or gpus % (tensor * pipeline * context):
        raise RecipeError(f"TP {tensor} x PP {pipeline} x CP {context} must divide the {gpus} GPUs")
    if s.kv_heads % tensor or s.heads % tensor:
        raise RecipeError(f"TP {tensor} must divide the {s.heads} attention heads and {s.kv_heads} KV heads")
    if s.layers % pipeline:
        raise RecipeError(f"PP {pipeline} must divide the {s.layers} layers")
    if not 0 < mfu <= 1:
        raise RecipeError(f"--mfu = {mfu}: must be in (0, 1], e.g. 0.35")
    ranks = tensor * pipeline * context
    weights = params_per_gpu(s, tensor, pipeline, vocab_rows or s.vocab) * dtype_bytes
    cache = kv_cache_bytes_per_token(s, dtype_bytes) * length / ranks
    memory = EvalMemory(weights=weights, kv_cache=cache,
                        activations=layer_working_set_bytes(s, length, tensor, context, dtype_bytes, kernels),
                        rope=4.0 * s.head_dim * length / context, overhead=OVERHEAD_BYTES)
    flops = prefill_flops(s, length)
    # a single prompt keeps one stage busy at a time: TP x CP GPUs share its FLOPs
    prefill_s = flops / (tensor * context * gpu.bf16_tflops * 1e12 * mfu)
    decode_s = pipeline * (weights + cache) / (hbm_bandwidth or gpu.hbm_bw)
    return EvalPlan(gpu, gpus, length, tensor, pipeline, context, gpus // ranks, memory, flops, prefill_s, decode_s)


def min_eval_context(s: Shape, gpu: GPU, length: int, *, gpus: int, tensor: int = 1, pipeline: int = 1,
                     **kwargs) -> int | None:
    """Smallest power-of-two CP at which the engine fits `length` tokens on `gpus` GPUs; None if none does."""
    cp = 1
    while tensor * pipeline * cp <= gpus:
        if gpus % (tensor * pipeline * cp) == 0 and eval_plan(s, gpu, length, gpus=gpus, tensor=tensor,
                                                                pipeline=pipeline, context=cp, **kwargs).fits:
            return cp
        cp *= 2
    return None


def eval_report(plans: list[EvalPlan], prompts: int, new_tokens: int, mfu: float, shape: Shape | None = None) -> str:
    """A table of `plans` (one per length, same layout): memory per GPU, fit, prefill and decode time, grid hours
    (every prompt a full prefill; with `shape`, also as NIAH depths sharing their haystack)."""
    p0 = plans[0]
    niah = f"{'as NIAH h':>10}" if shape is not None else ""
    gb = lambda x: f"{x / GB:7.1f}"  # noqa: E731
    lines = [f"eval plan: the Megatron engine (tools/niah.py --engine megatron) on {p0.gpus} x {p0.gpu.name}, "
             f"TP {p0.tensor} x PP {p0.pipeline} x CP {p0.context}, DP {p0.data} (prompts in parallel), bf16",
             f"  {'length':>9} {'weights':>7} {'KV':>7} {'layer':>7} {'other':>7} {'total':>7} GB  {'fits':<5}"
             f"{'prefill s':>10} {'decode ms':>10} {f'{prompts} prompts h':>14}{niah}"]
    for p in plans:
        m = p.memory
        lines.append(f"  {p.length:>9,} {gb(m.weights)} {gb(m.kv_cache)} {gb(m.activations)} "
                     f"{gb(m.rope + m.overhead)} {gb(m.total)}     {'yes' if p.fits else 'NO':<5}"
                     f"{p.prefill_s:>10.1f} {p.decode_step_s * 1e3:>10.2f} {p.grid_hours(prompts, new_tokens):>14.2f}"
                     + (f"{p.niah_hours(shape, prompts, new_tokens):>10.2f}" if shape is not None else ""))
    lines += [f"  prefill at {mfu:.0%} of {p0.gpu.bf16_tflops:g} TFLOP/s BF16 on TP x CP GPUs (causal count, no "
              "output layer); decode step: weights + KV cache read once at "
              f"{p0.gpu.hbm_bw / 1e12:g} TB/s (a lower bound); {new_tokens} decode steps per prompt",
              "  layer = one layer's forward working set on the rank's tokens; other = RoPE table + 8 GB "
              "CUDA/NCCL/allocator overhead"]
    if shape is not None:
        lines.append(f"  as NIAH: the {prompts} prompts as needle depths evenly spread over 0-100%, each run only "
                     "after the haystack it shares with the one before (the engine's KV cache); the column before: "
                     "every prompt a full prefill")
    return "\n".join(lines)
