"""FLOP and memory formulas of Llama-shaped models on GPUs (perf.md), pure functions of the numbers.

Every constant is in the block below with its source (tags as in docs/research/perf.md: [V]
verified, [S] secondary, [D] derived, [U] unconfirmed). The memory terms follow perf.md section 5 and add
the items it leaves out: RoPE tables and unfused RoPE's cos/sin, TE p2p context-parallel buffers, sequence-parallel
gathers, the chunked loss head, and the local
(CPU) kernel path whose saved tensors were itemised from Megatron-Core 0.16.1's local layer spec with torch
SDPA. `megatron_ext.plan` composes them for a recipe; `hand_need_bytes` is perf.md section 6's hand
computation of the CP needed for 1M-4M tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_ext.recipe import Recipe, RecipeError

# ---------------------------------------------------------------------------- constants (one place)

GB = 1e9  # perf.md counts memory in decimal GB; GPU capacities below are the marketed GB


@dataclass(frozen=True)
class GPU:
    """Peak figures of one accelerator. Bandwidths in bytes/s per direction, per GPU."""

    name: str
    memory_gb: float  # marketed capacity in GB (1e9 B); nvidia-smi shows ~7% more bytes, our headroom
    bf16_tflops: float  # dense tensor-core peak
    nvlink_bw: float  # intra-node (TP, and CP/DP inside a node)
    network_bw: float  # inter-node NIC per GPU (CP/DP across nodes)
    source: str
    hbm_bw: float = 0.0  # memory bandwidth (bytes/s): bounds a decode step (megatron_ext.eval_plan)


GPUS: dict[str, GPU] = {
    "h100-80gb": GPU("h100-80gb", 80.0, 989.4, 450e9, 50e9,
                     "perf.md §4: 989.4 TFLOP/s BF16 dense [S], NVLink4 900 GB/s bidir [V], IB NDR 50 GB/s/GPU [U], "
                     "HBM3 3.35 TB/s [S]", hbm_bw=3.35e12),
    "h200-141gb": GPU("h200-141gb", 141.0, 989.4, 450e9, 50e9,
                      "perf.md §4: same die as H100 [D], 141 GB HBM3e [V], 4.8 TB/s [S]", hbm_bw=4.8e12),
    "b200-180gb": GPU("b200-180gb", 180.0, 2250.0, 900e9, 50e9,
                      "NVIDIA DGX B200 datasheet (2.25 PFLOP/s BF16 dense, NVLink5 1.8 TB/s bidir) [U]; "
                      "180 GB per perf.md §1b; HBM3e 8 TB/s (same datasheet) [U]", hbm_bw=8e12),
}
GPU_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "b200": "b200-180gb"}

OVERHEAD_BYTES = 8 * GB  # CUDA context, NCCL, TE workspace, fragmentation [D, perf.md §6]
GRAD_BYTES = 4  # fp32 main grads: Megatron-LM default for bf16 and train.py (grad_reduce_in_fp32); perf.md §5b
RECOMPUTE_MODES = ("none", "selective", "full")


# ---------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the model needs (Llama family: GQA, SwiGLU, RMSNorm)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "Shape":
        m = recipe.model
        return cls(m.num_hidden_layers, m.hidden_size, m.intermediate_size, m.num_attention_heads,
                   m.num_key_value_heads or m.num_attention_heads,
                   m.head_dim or m.hidden_size // m.num_attention_heads, m.vocab_size, m.tie_word_embeddings)


def shape_from_hf_config(cfg: dict) -> Shape:
    """`Shape` of an HF Llama-family `config.json` dict (for KV-cache sizing of a released model)."""
    heads = cfg["num_attention_heads"]
    return Shape(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], heads,
                 cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                 cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))


def padded_vocab(vocab: int, divisible_by: int, tensor: int) -> int:
    """Embedding rows: vocab rounded up to a multiple of both `divisible_by` and TP.

    Megatron-LM pads to a multiple of divisible_by x TP, which makes the row count depend on TP
    (128256 -> 129024 at TP 8) so a checkpoint converted at TP 1 no longer loads at TP 8. The
    least common multiple keeps every power-of-two TP up to `divisible_by` on the same rows
    (128256 for Llama-3.1 at TP 1..128), while each TP rank still gets whole rows.
    """
    multiple = math.lcm(max(1, divisible_by), tensor)
    return -(-vocab // multiple) * multiple


def layer_matmul_params(s: Shape) -> int:
    """Weights of one layer's linear layers: Q, K, V, O and the SwiGLU FC1 (2 x ffn) and FC2."""
    return s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.ffn


def matmul_params(s: Shape) -> int:
    """N_matmul of perf.md §5a: every linear layer incl. the LM head, not the embedding lookup."""
    return s.layers * layer_matmul_params(s) + s.hidden * s.vocab


def total_params(s: Shape, vocab_rows: int | None = None) -> int:
    """All parameters (embedding, layers, norms, head); `vocab_rows` = padded vocabulary if given."""
    v = vocab_rows or s.vocab
    norms = s.layers * 2 * s.hidden + s.hidden
    return s.layers * layer_matmul_params(s) + norms + v * s.hidden * (1 if s.tied else 2)


def attention_core_train_flops_per_token(d_attn: int, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (3x forward) of one layer's attention core (QK^T and PV) per token, d_attn = heads x head_dim.

    Causal: over the average context (L+1)/2 -> 6 d_attn (L+1); non-causal (old NeMo/Megatron
    convention): 12 d_attn L (perf.md §5a).
    """
    return 6.0 * d_attn * (seq_len + 1) if causal else 12.0 * d_attn * seq_len


def train_flops_per_token(s: Shape, seq_len: int, causal: bool = True) -> float:
    """Model training FLOPs per token (3x forward): 6 N_matmul + attention core (perf.md §5a)."""
    attention = s.layers * attention_core_train_flops_per_token(s.heads * s.head_dim, seq_len, causal)
    return 6.0 * matmul_params(s) + attention


def train_flops(s: Shape, tokens: int, attention_pairs: float) -> float:
    """Model training FLOPs of `tokens` tokens whose causal attention spans `attention_pairs` (query, key) pairs per
    layer: a sequence of L tokens has L (L + 1) / 2; packed conversations, attention confined to each, the sum of
    theirs. For one sequence, L x `train_flops_per_token(s, L)`."""
    return 6.0 * matmul_params(s) * tokens + 12.0 * s.layers * s.heads * s.head_dim * attention_pairs


def kv_cache_bytes_per_token(s: Shape | dict, dtype_bytes: float = 2.0) -> float:
    """Inference KV cache per token: K and V of every layer, kv_heads x head_dim each (BF16: 2, FP8: 1).

    `s`: a `Shape` or an HF Llama `config.json` dict.
    """
    if isinstance(s, dict):
        s = shape_from_hf_config(s)
    return 2.0 * s.layers * s.kv_heads * s.head_dim * dtype_bytes


# ---------------------------------------------------------------------------- memory per GPU


def params_per_gpu(s: Shape, tensor: int, pipeline: int, vocab_rows: int) -> float:
    """Parameters on the busiest GPU: its share of layers and, with PP, one vocabulary matrix."""
    layer = layer_matmul_params(s) / tensor + 2 * s.hidden  # norms are replicated over TP
    vocab_mats = (1 if s.tied else 2) if pipeline == 1 else 1
    return s.layers // pipeline * layer + vocab_mats * vocab_rows * s.hidden / tensor + s.hidden


def model_state_bytes(params: float, shards: int, precision: str = "bf16",
                      distributed_optimizer: bool = True) -> dict[str, float]:
    """Weights, gradients and Adam states per GPU (perf.md §5b: bf16 -> 6 + 12/(DP*CP) B/param).

    bf16: bf16 weights, fp32 main grads, fp32 master copy + Adam m, v (12 B) sharded over the
    DP x CP group by the distributed optimizer. fp32: no master copy, so Adam states are 8 B.
    """
    weight = 2 if precision == "bf16" else 4
    optim = 12 if precision == "bf16" else 8
    shard = shards if distributed_optimizer else 1
    return {"weights": params * weight, "grads": params * (GRAD_BYTES if precision == "bf16" else 4),
            "optimizer": params * optim / shard}


def gathered_kv_bytes(s: Shape, length: float, tensor: int = 1, dtype_bytes: float = 2.0) -> float:
    """K and V of `length` tokens on one TP rank (kv_heads / TP heads each): with `length` the whole sequence, what
    the torch SDPA backend all-gathers over the CP group in every layer (megatron_ext/attention.py)."""
    return length * 2 * s.kv_heads * s.head_dim / tensor * dtype_bytes


# One layer's backward through the SDPA backend's all-gather under CP holds the gradient of its gathered K and V
# this many times over (megatron_ext/attention.py): the summed gradient of the whole sequence's K and V, and the
# next chunk's SDPA gradient of its key slice padded to the whole sequence (SliceBackward) before it is added;
# unshard's reordering then pads each piece the same way before the reduce-scatter. [D] Measured with the local
# dQ/dK/dV added (tests/distributed/test_plan_memory_cp.py): the core attention's backward peaks at 0.83-0.92 x that
# at CP 2, 0.90 at CP 4 and 0.94 at CP 8 (GQA 4:2), 0.89-0.95 at CP 4 (MHA), CPU kernels' temporaries included.
LOCAL_CP_GRAD_FACTOR = 2.0


def activation_bytes_per_token_layer(s: Shape, tensor: int = 1, sequence_parallel: bool = True,
                                     dtype_bytes: float = 2.0, kernels: str = "te", unfused_rope: bool = False,
                                     context: int = 1) -> float:
    """Bytes one layer keeps for backward per token (no recompute) on one TP rank.

    te (perf.md §5b, fused attention, fused SwiGLU): norm in/out for attention and MLP (4h),
    Q, K, V, attention output O, FC1 output (2 ffn) and FC2 input (ffn): 34 h for Llama-3.1-8B.
    local (Megatron local spec + torch SDPA, what runs on CPU; itemised from its saved tensors):
    each RMSNorm keeps input, normalised input and output (3h) plus an fp32 rstd; RoPE keeps cos and
    sin for Q and K (4 head_dim); SDPA keeps the fused QKV buffer (V is a view), rotated Q and K,
    its output and an fp32 log-sum-exp per head; the MLP keeps FC1 output, two GLU temporaries and
    the FC2 input (5 ffn). Sequence parallel divides the norm terms by TP too. RoPE's cos and sin are not split
    by TP (they broadcast over the heads); `unfused_rope` adds them to the te count, where perf.md assumes TE's
    fused RoPE: our model always applies RoPE unfused, to carry YaRN's attention factor (megatron_ext/rope.py).
    local with `context` (CP) > 1: the backend all-gathers K and V of the whole sequence and SDPA keeps them, CP
    tokens' worth per local token (`gathered_kv_bytes`), in place of the QKV buffer and the rotated K; it keeps
    rotated Q, each chunk's output and their concatenation copied for the projection (2 o), and the log-sum-exp.
    """
    t = tensor
    norm_div = t if sequence_parallel else 1
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    o = s.heads * s.head_dim
    rope = dtype_bytes * 4 * s.head_dim  # cos and sin, for Q and for K
    if kernels == "te":
        return dtype_bytes * (4 * s.hidden / norm_div + (qkv + o + 3 * s.ffn) / t) + (rope if unfused_rope else 0.0)
    if kernels == "local":
        norms = 2 * (3 * s.hidden * dtype_bytes + 4) / norm_div
        if context > 1:
            attn = dtype_bytes * (s.heads * s.head_dim + 2 * o) + 4 * s.heads + gathered_kv_bytes(s, context, 1,
                                                                                                    dtype_bytes)
        else:
            attn = dtype_bytes * (qkv + (s.heads + s.kv_heads) * s.head_dim + o) + 4 * s.heads
        return norms + attn / t + rope + dtype_bytes * 5 * s.ffn / t
    raise ValueError(f"kernels = {kernels!r}: expected 'te' or 'local'")


def activation_bytes(s: Shape, tokens: int, layers: int, recompute: str, tensor: int = 1,
                     sequence_parallel: bool = True, dtype_bytes: float = 2.0, kernels: str = "te",
                     in_flight: int = 1, recompute_layers: int | None = None, unfused_rope: bool = False,
                     context: int = 1) -> float:
    """Activation memory of `layers` layers for `tokens` tokens per micro-batch, `in_flight` micro-batches.

    none / selective: every layer's saved tensors (selective recompute of core attention saves
    nothing more once attention is fused, perf.md §5b). full (uniform, 1 layer per checkpoint):
    each layer keeps its input (h / TP with SP) and backward holds one layer's activations twice
    (recomputed tensors and their gradients): perf.md §5b/§6 "1 KB/token/layer + ~35 KB/token".
    full with `recompute_layers` = N (block): the first N layers keep their inputs, the other
    layers all their saved tensors; the backward's transient is then the larger of those other
    layers and the two layers' worth of a recomputed one (N = `layers` is full, N = 0 none).
    """
    per_layer = activation_bytes_per_token_layer(s, tensor, sequence_parallel, dtype_bytes, kernels, unfused_rope,
                                                 context)
    if recompute in ("none", "selective"):
        return tokens * layers * per_layer * in_flight
    if recompute == "full":
        layer_input = dtype_bytes * s.hidden / (tensor if sequence_parallel else 1)
        n = layers if recompute_layers is None else min(recompute_layers, layers)
        kept = (layers - n) * in_flight
        return tokens * (n * layer_input * in_flight + max(kept, 2) * per_layer)
    raise ValueError(f"recompute = {recompute!r}: expected one of {RECOMPUTE_MODES}")


def logits_bytes_per_token(vocab_rows: int, tensor: int = 1, dtype_bytes: float = 2.0,
                           fused_ce: bool = False) -> float:
    """Loss head per token: Megatron's vocab-parallel CE keeps the logits and an fp32 copy (bf16:
    2 + 4 = 6 B x V/TP, perf.md §5b; fp32 logits are used in place: 4 B); a fused/chunked CE keeps ~2 B."""
    if fused_ce:
        return 2.0 * vocab_rows / tensor
    return (dtype_bytes + (4.0 if dtype_bytes != 4 else 0.0)) * vocab_rows / tensor


def loss_head_bytes(s: Shape, tokens: int, vocab_rows: int, tensor: int = 1, sequence_parallel: bool = False,
                    dtype_bytes: float = 2.0, loss_head: str = "full", chunk_tokens: int = 2048,
                    fused_ce: bool = False) -> float:
    """Peak bytes of the loss head for `tokens` tokens on one GPU.

    full: Megatron's output layer + cross entropy, `logits_bytes_per_token` per token (`fused_ce` assumes a
    fused CE). chunked (`megatron_ext.loss_head`): one chunk's logits and their fp32 copy (plus, under
    sequence parallelism, the chunk's gathered hidden states and their gradient), one tensor of the output
    weight's size (dtype B x V/TP x h: under the trainer's DDP the head adds into the fp32 main_grad itself and
    keeps only each chunk's product, in bf16, which is then the placeholder gradient autograd hands on; in fp32
    that placeholder, or without DDP the head's own fp32 accumulator) and 4 B of log-sum-exp per token.
    """
    if loss_head == "full":
        return tokens * logits_bytes_per_token(vocab_rows, tensor, dtype_bytes, fused_ce)
    if loss_head != "chunked":
        raise ValueError(f"loss_head = {loss_head!r}: expected 'full' or 'chunked'")
    gathered = 2 * s.hidden * dtype_bytes if sequence_parallel and tensor > 1 else 0.0
    per_chunk_token = logits_bytes_per_token(vocab_rows, tensor, dtype_bytes) + gathered
    weight_grad = dtype_bytes * vocab_rows / tensor * s.hidden
    return min(chunk_tokens, tokens) * per_chunk_token + weight_grad + 4.0 * tokens


def rope_table_bytes(seq_len: int, context: int, head_dim: int) -> float:
    """The fp32 angle table [L/CP, head_dim] of this rank's positions (`megatron_ext.rope.ScaledRotaryEmbedding`
    builds only those; Megatron-Core's own RotaryEmbedding builds all L on every rank: ~2 GiB at 4M)."""
    return 4.0 * head_dim * seq_len / context


def sp_buffer_bytes(s: Shape, tokens: int, tensor: int, sequence_parallel: bool, dtype_bytes: float = 2.0) -> float:
    """Sequence parallelism's full-sequence transients of one layer: the all-gathered input of QKV or FC1 (formed
    in forward, again for the weight gradient in backward) and the input gradient before its reduce-scatter,
    each [tokens, h] on every TP rank while the rest of the layer is split by TP."""
    return 2 * tokens * s.hidden * dtype_bytes if sequence_parallel and tensor > 1 else 0.0


def cp_buffer_bytes(s: Shape, tokens: int, tensor: int, context: int, dtype_bytes: float = 2.0,
                    kernels: str = "te") -> float:
    """te: TE p2p ring: double-buffered K/V in forward, K/V + dK/dV double buffers in backward (one
    layer at a time), plus an fp32 output accumulator (perf.md §6 'not modelled': ~0.13 GB/layer).
    local (torch SDPA, all-gather CP): one layer's backward transient, the gradients of its gathered K and V
    (`LOCAL_CP_GRAD_FACTOR` x `gathered_kv_bytes` of the whole sequence) and its local dQ, dK, dV; what its forward
    gathers is kept for backward, so `activation_bytes` counts it."""
    if context == 1:
        return 0.0
    if kernels == "local":
        local_grads = tokens * (s.heads + 2 * s.kv_heads) * s.head_dim / tensor * dtype_bytes  # dQ, dK, dV
        return LOCAL_CP_GRAD_FACTOR * gathered_kv_bytes(s, tokens * context, tensor, dtype_bytes) + local_grads
    kv = 2 * s.kv_heads * s.head_dim / tensor * dtype_bytes
    return tokens * (4 * kv + 4.0 * s.heads * s.head_dim / tensor)


@dataclass(frozen=True)
class Memory:
    """Peak bytes on the busiest GPU."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    rope: float
    cp_buffers: float
    sp_buffers: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))



def hand_need_bytes(s: Shape, seq_len: int, context: int, recompute: str, tensor: int = 8,
                    fused_ce: bool = False) -> float:
    """perf.md §6 per-GPU need (TP=8, PP=1, DP=1, BF16, fused attention, SP, unpadded vocabulary):
    states sharded over CP + tokens x (activations + logits) + 8 GB overhead."""
    tokens = seq_len // context
    states = model_state_bytes(params_per_gpu(s, tensor, 1, s.vocab), context)
    return (sum(states.values()) + activation_bytes(s, tokens, s.layers, recompute, tensor)
            + tokens * logits_bytes_per_token(s.vocab, tensor, 2.0, fused_ce) + OVERHEAD_BYTES)


def min_context_hand(s: Shape, seq_len: int, gpu: GPU, recompute: str, tensor: int = 8,
                     fused_ce: bool = False, max_cp: int = 64) -> int | None:
    """perf.md §6: smallest power-of-two CP whose `hand_need_bytes` fits `gpu`; None beyond `max_cp`."""
    cp = 1
    while cp <= max_cp:
        if hand_need_bytes(s, seq_len, cp, recompute, tensor, fused_ce) <= gpu.memory_gb * GB:
            return cp
        cp *= 2
    return None


def resolve_gpu(name: str | None) -> GPU:
    """GPU by name or alias; RecipeError listing the known ones otherwise."""
    known = ", ".join(list(GPUS) + list(GPU_ALIASES))
    if name is None:
        raise RecipeError(f"no GPU given: set cluster.gpu in the recipe or pass --gpu (known: {known})")
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise RecipeError(f"--gpu {name!r}: unknown GPU; known: {known}")
    return GPUS[key]


def gpu_from_device_name(name: str) -> GPU | None:
    """The GPUS entry of a CUDA device's name (`torch.cuda.get_device_name`, as nvidia-smi prints it: 'NVIDIA H100
    80GB HBM3', 'NVIDIA H200', 'NVIDIA B200'), or None where GPUS lacks its peak (PCIe and NVL parts, GH200, ...)."""
    words = name.upper().replace("-", " ").split()
    if "PCIE" in words or "NVL" in words:
        return None
    for chip, key in (("H100", "h100-80gb"), ("H200", "h200-141gb"), ("B200", "b200-180gb")):
        if chip in words:
            return GPUS[key]
    return None
