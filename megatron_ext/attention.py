"""Core-attention backends plugged into Megatron-Core's layer spec.

- Transformer Engine's `TEDotProductAttention` (GPU; FP8, CP p2p/a2a/all_gather/a2a+p2p): used
  through Megatron's TE spec, nothing to write here.
- `TorchSDPAttention`: torch `scaled_dot_product_attention`, for CPU and for GPUs without TE. SDPA picks its
  kernel itself unless `runtime.sdpa_kernel` forces one (`SDPA_KERNELS`): at 128K tokens attention is ~70% of a
  layer's FLOPs, so the kernel decides the MFU of this path (bench/sdpa_kernels_bench.py measures each). Under
  CP only flash may be forced (recipe_rules): the chunks' lower-right causal bias has no other mask-free kernel.

Shapes follow Megatron's core-attention contract: q `[s, b, nh, d]`, k/v `[s, b, ng, d]` (ng = KV
heads on this TP rank), output `[s, b, nh * d]`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from torch.nn.attention.bias import causal_lower_right

from megatron_ext.context_parallel import cp_chunk_ids, unshard

SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")  # auto: SDPA's own choice (runtime.sdpa_kernel)


def _no_kernel(e: RuntimeError) -> bool:
    """Whether SDPA refused the call for want of a kernel (torch's two wordings: CUDA's and the CPU's)."""
    text = str(e).lower()
    return "no available kernel" in text or "no viable backend" in text


def _backend(kernel: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[kernel]


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward reduce-scatters: the sum over ranks of the gradient of our
    part (on NCCL half the bytes of an all-reduce; gloo, since torch 2.2, does it with one)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


_BOUNDS: list = [None, []]  # the last cu_seqlens tensor and its values (held, so no other tensor takes its id)


def _sample_bounds(cu: torch.Tensor) -> list[int]:
    """`cu.tolist()` once per microbatch: every layer gets the same tensor, and on a GPU each copy to the host
    waits for the work queued before it."""
    if _BOUNDS[0] is not cu:
        _BOUNDS[:] = [cu, cu.tolist()]
    return _BOUNDS[1]


def zigzag_causal_attention(sdpa, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                            cp_size: int, cp_rank: int, prefix: int = 0) -> torch.Tensor:
    """Causal attention of this CP rank's zigzag queries over the whole sequence's keys.

    q `[b, nh, 2c, d]` holds chunks `cp_chunk_ids(cp_size, cp_rank)` (c tokens each) in local
    order; k/v `[b, ng, s, d]` are in global order, s = 2 x CP x c. Chunk j's queries see keys
    `[0, (j + 1) c)` with the diagonal at the bottom right: one SDPA call per chunk with a
    lower-right causal bias, which CUDA flash attention takes as its own causal flag (no mask
    tensor; flash takes no masks, so one dense `[2c, s]` mask leaves SDPA the O(s^2)-memory kernels).
    It also skips the keys after each chunk (CPU: 0.56x the time of the dense mask at s = 16K,
    bench/cp_attention_bench.py).
    `sdpa(q, k, v, mask=...)` is the SDPA call to use. `prefix`: keys that come before the sequence and every
    query sees (a cached prompt prefix, `megatron_ext.evaluate.kv_cache`), s = prefix + 2 x CP x c.
    Returns `[b, nh, 2c, d]`.
    """
    c = q.shape[2] // 2
    outs = []
    for q_chunk, chunk in zip(q.split(c, dim=2), cp_chunk_ids(cp_size, cp_rank)):
        end = prefix + (chunk + 1) * c
        outs.append(sdpa(q_chunk, k_all[:, :, :end], v_all[:, :, :end], mask=causal_lower_right(c, end)))
    return torch.cat(outs, dim=2)


class TorchSDPAttention(MegatronModule):
    """Attention with torch SDPA: causal, GQA-aware, context parallel by all-gathering K/V.

    CP (the Llama-3 approach): each rank keeps its zigzag chunks of Q and gathers K/V of the whole
    sequence from the CP group, then attends per chunk (`zigzag_causal_attention`). Packed sequences
    (THD, `packed_seq_params`) are attended per sample; they are not supported together with CP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        sdpa_kernel: str = "auto",
    ):
        super().__init__(config=config)
        if sdpa_kernel not in SDPA_KERNELS:
            raise ValueError(f"sdpa_kernel {sdpa_kernel!r}: expected one of {list(SDPA_KERNELS)}")
        self.sdpa_kernel = sdpa_kernel
        self._expand_kv = False  # set when the forced kernel refuses grouped K/V (enable_gqa): K/V repeated instead
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_size = config.context_parallel_size
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None

    def _cp_group(self):
        if self.cp_group is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        return self.cp_group

    def _sdpa(self, q, k, v, mask=None, causal=True):
        """q `[b, nh, sq, d]`, k/v `[b, ng, sk, d]` -> `[b, nh, sq, d]`; `mask` replaces `causal`."""
        if self.sdpa_kernel == "auto":
            return self._call_sdpa(q, k, v, mask, causal)
        from torch.nn.attention import sdpa_kernel

        # Forward and, under recompute, its rerun in the backward pass: the backward itself is the kernel's own.
        with sdpa_kernel([_backend(self.sdpa_kernel)]):
            grouped = k.shape[1] != q.shape[1]
            if grouped and not self._expand_kv:
                try:
                    return self._call_sdpa(q, k, v, mask, causal)
                except RuntimeError as e:  # some kernels refuse enable_gqa (bench/sdpa_kernels_bench.py records which)
                    if not _no_kernel(e):
                        raise
                    self._expand_kv = True
            if grouped:  # [b, ng, s, d] -> [b, nh, s, d], each KV head once per query head of its group
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            try:
                return self._call_sdpa(q, k, v, mask, causal)
            except RuntimeError as e:
                if not _no_kernel(e):
                    raise
                raise RuntimeError(f"runtime.sdpa_kernel = {self.sdpa_kernel!r}: torch has no such kernel for these "
                                   f"inputs ({q.dtype}, {q.device.type}, head dim {q.shape[-1]}"
                                   f"{', an explicit mask' if mask is not None else ''}); use runtime.sdpa_kernel=auto"
                                   f" ({' '.join(str(e).split())[:300]})") from None

    def _call_sdpa(self, q, k, v, mask, causal):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # padding_causal is what TE calls causal over packed (THD) sequences; an explicit mask, or another kind
        # (bottom-right causal, arbitrary), would be silently dropped: refuse it instead
        if kind not in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.no_mask) or (
                attention_mask is not None):
            raise NotImplementedError(f"attention (sdpa backend): attn_mask_type {kind.name}"
                                      f"{' with an attention_mask tensor' if attention_mask is not None else ''}; "
                                      "it runs causal (top-left) or unmasked attention only")
        causal = kind != AttnMaskType.no_mask
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params, causal)
        s, b, nh, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.cp_size == 1:
            return self._sdpa(q, k, v, causal=causal).permute(2, 0, 1, 3).reshape(s, b, nh * d)
        group = self._cp_group()
        # [cp * s_local, b, ng, d] in rank order -> global order
        k_all = unshard(_AllGatherSeq.apply(key, group), self.cp_size).permute(1, 2, 0, 3)
        v_all = unshard(_AllGatherSeq.apply(value, group), self.cp_size).permute(1, 2, 0, 3)
        if causal:
            out = zigzag_causal_attention(self._sdpa, q, k_all, v_all, self.cp_size, dist.get_rank(group))
        else:
            out = self._sdpa(q, k_all, v_all, causal=False)
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)

    def _forward_packed(self, query, key, value, params, causal):
        """THD: q `[t, nh, d]`, k/v `[t, ng, d]`; samples delimited by `cu_seqlens_q` -> `[t, nh * d]`."""
        if self.cp_size != 1:
            raise NotImplementedError("packed sequences are not split for context parallelism (SFT runs at "
                                      "parallel.context=1)")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = _sample_bounds(cu)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
                outs.append(self._sdpa(q, k, v, causal=causal)[0].permute(1, 0, 2))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)
