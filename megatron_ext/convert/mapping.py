"""The one HF Llama <-> Megatron-Core mapping table, and the pure tensor transforms it names.

Megatron keys are the `torch_dist` checkpoint keys (what `GPTModel.sharded_state_dict()` writes and
`load_plain_tensors` returns). Per-layer keys (`decoder.layers.*`) are stored stacked, with a
leading layer axis and no layer index; the HF side has one tensor per layer. The local and the
Transformer Engine layer specs write the same keys (the local spec maps `input_layernorm.` and
`pre_mlp_layernorm.` onto TE's fused `layer_norm_weight` names), so one table serves both; the
module names that differ inside a live model are listed in `MODULE_NAMES`.

Both directions are derived from `TABLE`: `to_megatron` and `to_hf` dispatch on an entry's `kind`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["copy", "qkv", "gate_up", "vocab"]
LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor and the HF tensor(s) it is made of (`{layer}` = HF layer index)."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"
    untied_only: bool = False  # absent when input and output embeddings are shared
    tp_axis: int | None = None  # the axis Megatron splits over TP ranks (of the per-layer tensor); None: replicated

    @property
    def per_layer(self) -> bool:
        return self.megatron.startswith(LAYER_PREFIX)

    def hf_names(self, layer: int | None) -> list[str]:
        return [n.format(layer=layer) for n in self.hf]


_L = "model.layers.{layer}."
TABLE: tuple[Entry, ...] = (
    Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", tp_axis=0),
    Entry("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (_L + "input_layernorm.weight",)),
    # rows grouped per KV group g: [q heads of g; k_g; v_g] (Megatron's SelfAttention layout)
    Entry("decoder.layers.self_attention.linear_qkv.weight",
          (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), "qkv",
          tp_axis=0),
    Entry("decoder.layers.self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), tp_axis=1),
    Entry("decoder.layers.mlp.linear_fc1.layer_norm_weight", (_L + "post_attention_layernorm.weight",)),
    # SwiGLU: Megatron's MLP chunks fc1's output in two, silu(first) * second; each half is split over TP
    Entry("decoder.layers.mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up",
          tp_axis=0),
    Entry("decoder.layers.mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), tp_axis=1),
    Entry("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Entry("output_layer.weight", ("lm_head.weight",), "vocab", untied_only=True, tp_axis=0),
)

# Module (state_dict) names of the per-layer norms inside a live model, by layer spec. Checkpoint
# keys are the same for both specs; these matter only to code that walks `named_parameters()`.
MODULE_NAMES = {
    "local": {"decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "decoder.layers.mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"},
    "te": {"decoder.layers.self_attention.linear_qkv.layer_norm_weight": "self_attention.linear_qkv.layer_norm_weight",
           "decoder.layers.mlp.linear_fc1.layer_norm_weight": "mlp.linear_fc1.layer_norm_weight"},
}

# HF tensors that carry no weights and are dropped on import.
HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def entries(tied: bool) -> list[Entry]:
    """Table entries present for a model with (tied=True) or without shared embeddings."""
    return [e for e in TABLE if not (tied and e.untied_only)]


def expected_hf_names(cfg: dict) -> list[str]:
    """Every HF tensor name a Llama checkpoint of `cfg` (normalised) must contain."""
    names = []
    for e in entries(cfg["tie_word_embeddings"]):
        layers = range(cfg["num_hidden_layers"]) if e.per_layer else [None]
        for layer in layers:
            names += e.hf_names(layer)
    return names


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of a Llama config (normalised), for input checks."""
    h, f, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    by_suffix = {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (nh * d, h), "k_proj.weight": (ng * d, h), "v_proj.weight": (ng * d, h),
        "o_proj.weight": (h, nh * d), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
    }
    out = {}
    for name in expected_hf_names(cfg):
        suffix = ".".join(name.split(".")[-2:])
        out[name] = by_suffix[suffix]
    return out


# ---- pure transforms --------------------------------------------------------------------------

def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """HF q `[nh*d, H]`, k/v `[ng*d, H]` -> Megatron linear_qkv `[ng*(nh/ng + 2)*d, H]`, grouped per KV head."""
    d, hidden = k.shape[0] // num_groups, q.shape[1]
    per_group = num_heads // num_groups
    q = q.reshape(num_groups, per_group, d, hidden)
    k = k.reshape(num_groups, 1, d, hidden)
    v = v.reshape(num_groups, 1, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`."""
    per_group = num_heads // num_groups
    hidden = qkv.shape[1]
    d = qkv.shape[0] // (num_groups * (per_group + 2))
    grouped = qkv.reshape(num_groups, per_group + 2, d, hidden)
    q = grouped[:, :per_group].reshape(num_heads * d, hidden)
    k = grouped[:, per_group].reshape(num_groups * d, hidden)
    v = grouped[:, per_group + 1].reshape(num_groups * d, hidden)
    return q.contiguous(), k.contiguous(), v.contiguous()


def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocab padding: append zero rows up to `rows` (padded ids are never inputs or labels)."""
    if w.shape[0] > rows:
        raise ValueError(f"cannot pad {w.shape[0]} rows down to {rows}")
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def to_megatron(entry: Entry, hf: list[torch.Tensor], cfg: dict, padded_vocab: int) -> torch.Tensor:
    """The Megatron tensor of `entry` (one layer's slice for per-layer entries) from its HF tensors."""
    if entry.kind == "copy":
        return hf[0]
    if entry.kind == "qkv":
        return merge_qkv(*hf, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    if entry.kind == "gate_up":
        return torch.cat(hf, dim=0)
    if entry.kind == "vocab":
        return pad_rows(hf[0], padded_vocab)
    raise ValueError(f"unknown mapping kind {entry.kind!r}")


def to_hf(entry: Entry, t: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
    """The HF tensors of `entry` (in `entry.hf` order) from its Megatron tensor (one layer's slice)."""
    if entry.kind == "copy":
        return [t]
    if entry.kind == "qkv":
        return list(split_qkv(t, cfg["num_attention_heads"], cfg["num_key_value_heads"]))
    if entry.kind == "gate_up":
        gate, up = t.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]
    if entry.kind == "vocab":
        return [t[: cfg["vocab_size"]].contiguous()]  # strip padded rows
    raise ValueError(f"unknown mapping kind {entry.kind!r}")


def entry_for_key(key: str) -> Entry:
    """The table entry of a Megatron checkpoint key."""
    for e in TABLE:
        if e.megatron == key:
            return e
    raise KeyError(key)
