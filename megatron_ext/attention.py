"""Core-attention backends plugged into Megatron-Core's layer spec.

- Transformer Engine's `TEDotProductAttention` (GPU; FP8, CP p2p/a2a/all_gather/a2a+p2p): used
  through Megatron's TE spec, nothing to write here.
- `TorchSDPAttention`: torch `scaled_dot_product_attention`, for CPU and for GPUs without TE.

Shapes follow Megatron's core-attention contract: q `[s, b, nh, d]`, k/v `[s, b, ng, d]` (ng = KV
heads on this TP rank), output `[s, b, nh * d]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchSDPAttention(MegatronModule):
    """Causal (or padding-free) attention with torch SDPA; GQA without materialising repeated K/V."""

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
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("TorchSDPAttention does not implement context parallelism yet")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("TorchSDPAttention: packed (THD) sequences need Transformer Engine")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        s, b, nh, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v,
            is_causal=mask_type == AttnMaskType.causal,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != nh,
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)
