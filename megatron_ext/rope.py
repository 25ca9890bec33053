"""Scaled rotary position embedding (RoPE) for Megatron-Core, exact to Hugging Face transformers.

Every Llama rope type (default, linear, dynamic, yarn, longrope, llama3) is read from an HF
`config.json` dict, in the transformers-4 form (`rope_theta` + `rope_scaling`, also the old `type`
key) or the transformers-5 form (`rope_parameters`), and computed formula by formula as
transformers' `ROPE_INIT_FUNCTIONS` do, in float32.

UltraLong (arXiv 2504.06214) extends Llama-3.1-8B from 128K to 1M/2M/4M tokens by replacing its
`llama3` scaling with YaRN: `rope_theta` 500000, `original_max_position_embeddings` 8192,
`factor` 128 / 256 / 512 (= target length / 8192), `beta_fast` 4 and `beta_slow` 1 (YaRN's
beta = 4, alpha = 1), attention factor 0.1 ln(factor) + 1 = 1.485 / 1.555 / 1.624 (HF default).
`ULTRALONG_ROPE` (= `presets.ROPE_PRESETS`) holds these blocks; recipes use them as
`rope: {preset: ultralong-1m}` or spelled out. The paper gives no mscale / attention factor, so the
HF default is assumed (see docs/research/paper.md section 2).

Parsing and validation of the rope block (pure Python, also run at recipe load) live in
`megatron_ext.rope_spec`; this module computes frequencies and the Megatron tables.

How it plugs into Megatron-Core 0.16.1:

- `ScaledRotaryEmbedding` (a `RotaryEmbedding` subclass) replaces `GPTModel.rotary_pos_emb`. Its
  table holds rotation angles `[s, 1, 1, rot_dim]` in float32 for the positions this CP rank holds
  only (zigzag chunks r and 2*CP-1-r); no tensor of global length is made. Angles are formed in
  float64 and reduced to [-pi, pi] before rounding, so cos/sin stay accurate to ~1e-7 even at
  position 4M - 1 (a float32 angle there would be off by up to 0.125 rad); or, with
  `rope_angle_precision: float32` in the config (`rope.angle_precision` in a recipe), as the float32
  product transformers and serving engines form (`megatron_ext.rope_angles`).
- The attention factor (YaRN, longrope) multiplies cos and sin, as transformers' Llama does.
  Megatron applies such a factor in one place only: `attention.py` passes
  `_yarn_get_concentration_factor_from_config(config)` as `mscale` to `apply_rotary_pos_emb`.
  `attach_rotary_embedding` sets those config attributes so that value equals our factor, checks it
  on the config of every module, and the embedding re-checks it at every forward. Paths that ignore
  `mscale` (TE fused RoPE, whose THD branch drops it silently; fused single-QKV RoPE; dynamic-batching
  inference, flash-decode) are errors when the factor is not 1, at build time and again at forward.
  `model.py` builds with `apply_rope_fusion=False`; tests/unit/test_rope_model.py guards that.

Limitation: for THD packed sequences Megatron slices the table per sub-sequence inside attention,
so there the table covers [0, longest sub-sequence) and is not CP-local.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.context_parallel import cp_positions
from megatron_ext.rope_angles import rope_angles
from megatron_ext.runtime.distributed import rank_device
from megatron_ext.rope_spec import ROPE_TYPES, ULTRALONG_ROPE, RopeConfigError, RopeSpec, rope_spec

try:  # Megatron-Core is needed only for the embedding module, not for `rope_frequencies`
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
except ImportError:  # pragma: no cover
    RotaryEmbedding = torch.nn.Module

__all__ = ["ROPE_TYPES", "ULTRALONG_ROPE", "RopeConfigError", "RopeSpec", "ScaledRotaryEmbedding",
           "attach_rotary_embedding", "cp_local_positions", "rope_angles", "rope_frequencies", "rope_spec",
           "set_attention_factor"]


# ---------------------------------------------------------------------------- frequencies


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2] fp32, as transformers


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base, factor = spec.dim, spec.theta, spec.params["factor"]
    orig = spec.params["original_max_position_embeddings"]
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = spec.get("mscale"), spec.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # transformers tests truthiness, so 0 means "not set"
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = spec.get("beta_fast") or 32, spec.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # channel pair that turns `rotations` times in `orig` tokens
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.params.get("truncate", True):  # transformers reads truncate with .get, so null disables it
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency (fast channels), 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(spec: RopeSpec) -> torch.Tensor:
    inv_freq = 1.0 / (spec.theta ** _exponents(spec.dim))
    factor, low, high = spec.params["factor"], spec.params["low_freq_factor"], spec.params["high_freq_factor"]
    old_len = spec.params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def frequencies_from_spec(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """`rope_frequencies` for a parsed `RopeSpec`."""
    kind, p = spec.rope_type, spec.params
    if kind == "yarn":
        return _yarn(spec)
    if kind == "llama3":
        return _llama3(spec), 1.0
    if kind == "dynamic":  # NTK-aware base, grown for sequences longer than max_position_embeddings
        max_pos = spec.max_position_embeddings
        length = max_pos if seq_len is None else max(seq_len, max_pos)
        base = spec.theta * ((p["factor"] * length / max_pos) - (p["factor"] - 1)) ** (spec.dim / (spec.dim - 2))
        return 1.0 / (base ** _exponents(spec.dim)), 1.0
    if kind == "longrope":
        orig, factor = p["original_max_position_embeddings"], p["factor"]
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = p["long_factor"] if seq_len and seq_len > orig else p["short_factor"]
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * spec.theta ** _exponents(spec.dim))
        return inv_freq, float(attention_factor)
    inv_freq = 1.0 / (spec.theta ** _exponents(spec.dim))
    return (inv_freq / p["factor"] if kind == "linear" else inv_freq), 1.0


def rope_frequencies(hf_config: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq `[rot_dim/2]` float32, attention_factor) of an HF config, equal to transformers'.

    `seq_len` is the sequence length the table is for; only `dynamic` (grows its base beyond
    max_position_embeddings) and `longrope` (long factors beyond the original length) depend on it.
    Raises `RopeConfigError` naming the field for a bad rope block.
    """
    return frequencies_from_spec(rope_spec(hf_config), seq_len)


# ---------------------------------------------------------------------------- tables


def cp_local_positions(seq_len: int, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Positions (int64) CP rank `cp_rank` holds: zigzag chunks r and 2*CP-1-r of 2*CP equal chunks."""
    if cp_size == 1:  # any length (inference, HF parity), not only multiples of 2
        return torch.arange(seq_len, dtype=torch.int64)
    return cp_positions(seq_len, cp_size, cp_rank)  # the same split the batch gets


def _concentration_attrs(spec: RopeSpec, factor: float) -> dict:
    """Values of Megatron's `yarn_*` config attributes whose concentration factor equals `factor`."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    if spec.rope_type == "yarn" and spec.get("attention_factor") is None:
        natural = {"yarn_rotary_scaling_factor": spec.params["factor"], "yarn_mscale": spec.get("mscale"),
                   "yarn_mscale_all_dim": spec.get("mscale_all_dim")}
        if _yarn_get_concentration_factor(*natural.values()) == factor:
            return natural
    # Any other factor a: Megatron computes (0.1 m ln(s) + 1) / (0.1 m_all ln(s) + 1); s = e, m_all = 0 gives
    # 0.1 m + 1, so m = 10 (a - 1).
    return {"yarn_rotary_scaling_factor": math.e, "yarn_mscale": (factor - 1.0) / 0.1, "yarn_mscale_all_dim": 0.0}


def check_attention_factor(config, attention_factor: float, spec: RopeSpec) -> None:
    """Raise unless attention built from `config` multiplies cos/sin by exactly `attention_factor`."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    got = _yarn_get_concentration_factor_from_config(config)
    if not math.isclose(got, attention_factor, rel_tol=1e-12):
        raise RuntimeError(f"RoPE attention factor: attention would apply {got}, the rope config needs "
                           f"{attention_factor}; the config's yarn_* attributes were changed after build")
    if attention_factor != 1.0:
        for flag in ("apply_rope_fusion", "fused_single_qkv_rope", "flash_decode"):
            if getattr(config, flag, False):
                raise RopeConfigError(
                    f"{flag} = True with RoPE attention factor {attention_factor:.6g} ({spec.where}.rope_type "
                    f"{spec.rope_type!r}): that path ignores the factor (TE's fused THD RoPE drops it silently); "
                    f"set {flag}=False")


class ScaledRotaryEmbedding(RotaryEmbedding):
    """Megatron `RotaryEmbedding` for any HF rope type, CP-local, carrying its attention factor.

    `forward(max_seq_len, offset, packed_seq, cp_group)` returns angles `[s_local, 1, 1, rot_dim]`
    float32, the contract of Megatron's `apply_rotary_pos_emb`.
    """

    def __init__(self, hf_config: dict, *, rotary_interleaved: bool = False, cp_group=None):
        spec = rope_spec(hf_config)
        super().__init__(kv_channels=spec.head_dim, rotary_percent=spec.partial_rotary_factor,
                         rotary_interleaved=rotary_interleaved, rotary_base=spec.theta,
                         use_cpu_initialization=True, cp_group=cp_group)
        self.spec = spec
        self.inv_freq, self.attention_factor = frequencies_from_spec(spec)
        self.config = None  # the TransformerConfig whose attention applies our factor; set by `bind`
        self._cache: tuple | None = None
        # Decoding with a KV cache: the global positions `[n]` of the new tokens, the same on every CP rank
        # (`megatron_ext.evaluate.kv_cache`); None: positions 0 .. max_seq_len - 1, zigzag-split over CP.
        self.positions: torch.Tensor | None = None

    # -- guards ------------------------------------------------------------------------------
    def bind(self, config) -> None:
        """Attach to the model's TransformerConfig and check that attention will apply our factor."""
        self.config = config
        self.check_attention_path()

    def check_attention_path(self) -> None:
        """Raise if Megatron's attention would apply another factor or could bypass it."""
        if self.config is None:
            raise RuntimeError("ScaledRotaryEmbedding is not bound to a TransformerConfig; use attach_rotary_embedding")
        check_attention_factor(self.config, self.attention_factor, self.spec)

    def get_rotary_seq_len(self, inference_context, *args, **kwargs) -> int:
        if (self.attention_factor != 1.0 and inference_context is not None
                and not inference_context.is_static_batching()):
            raise RopeConfigError("dynamic-batching inference applies RoPE without the attention factor "
                                  f"{self.attention_factor:.6g}; use static batching")
        return super().get_rotary_seq_len(inference_context, *args, **kwargs)

    # -- tables ------------------------------------------------------------------------------
    @property
    def length_dependent(self) -> bool:
        """Whether the table of a position depends on the sequence length (dynamic, longrope), as in transformers."""
        return self.spec.rope_type in ("dynamic", "longrope")

    def frequencies(self, seq_len: int) -> torch.Tensor:
        """inv_freq `[rot_dim/2]` for a table of global length `seq_len` (dynamic/longrope depend on it)."""
        if self.length_dependent:
            return frequencies_from_spec(self.spec, seq_len)[0]
        return self.inv_freq

    def _layout(self, angles: torch.Tensor) -> torch.Tensor:
        if self.rotary_interleaved:  # [a0, a0, a1, a1, ...]
            return angles.repeat_interleave(2, dim=-1)
        return torch.cat((angles, angles), dim=-1)  # HF rotate_half layout [a0..a_{d/2-1}, a0..]

    def local_table(self, seq_len: int, cp_size: int = 1, cp_rank: int = 0, offset: int = 0) -> torch.Tensor:
        """Angles `[s/cp, 1, 1, rot_dim]` float32 for CP rank `cp_rank` of a sequence of `seq_len` positions."""
        return self._layout(self.get_freqs_non_repeated(seq_len, offset, cp_size, cp_rank))[:, None, None, :]

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0, cp_size: int = 1,
                               cp_rank: int = 0) -> torch.Tensor:
        """Angles `[s/cp, rot_dim/2]` float32 (no channel duplication) for CP rank `cp_rank`."""
        positions = cp_local_positions(max_seq_len, cp_size, cp_rank).to(rank_device()) + offset  # [s/cp]
        return rope_angles(positions, self.frequencies(max_seq_len + offset).to(rank_device()), self.spec.angle_precision)

    def get_cos_sin(self, max_seq_len: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[s, rot_dim/2]` with the attention factor applied (flash-decode inference path)."""
        angles = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cos(angles) * self.attention_factor, torch.sin(angles) * self.attention_factor

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        return self.local_table(max_seq_len, offset=offset)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        self.check_attention_path()
        if self.positions is not None:
            if self.length_dependent:
                raise RopeConfigError(f"rope_type {self.spec.rope_type!r}: decoding at given positions needs a "
                                      "table that does not depend on the sequence length")
            angles = rope_angles(self.positions.to(rank_device()), self.inv_freq.to(rank_device()),
                                 self.spec.angle_precision)
            return self._layout(angles)[:, None, None, :]
        group = cp_group if cp_group is not None else self.cp_group
        cp_size, cp_rank = (group.size(), group.rank()) if group is not None else (1, 0)
        if packed_seq:  # THD: attention picks each sub-sequence's CP positions from the full table
            cp_size, cp_rank = 1, 0
        key = (max_seq_len, offset, cp_size, cp_rank)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.local_table(max_seq_len, cp_size, cp_rank, offset))
        return self._cache[1]


def attach_rotary_embedding(model, hf_config: dict) -> None:
    """Install `ScaledRotaryEmbedding` as `model.rotary_pos_emb` and make attention apply its factor.

    `model` is a Megatron `GPTModel` built with position_embedding_type='rope'. Raises
    `RopeConfigError` for a bad rope block or a fused-RoPE path that would drop the factor.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    old = getattr(model, "rotary_pos_emb", None)
    if old is None:
        if getattr(model, "position_embedding_type", "rope") == "rope" and not model.config.multi_latent_attention:
            raise RuntimeError("GPTModel has no rotary_pos_emb although position_embedding_type is 'rope'")
        return
    if model.position_embedding_type != "rope":
        raise RopeConfigError(f"position_embedding_type = {model.position_embedding_type!r}: build the GPTModel "
                              "with 'rope'; scaling comes from the HF rope block")
    emb = ScaledRotaryEmbedding(hf_config, rotary_interleaved=model.config.rotary_interleaved, cp_group=old.cp_group)
    if emb.inv_freq.shape != old.inv_freq.shape:
        raise RopeConfigError(f"rotary channels: the rope config gives {2 * emb.inv_freq.numel()}, the model "
                              f"{2 * old.inv_freq.numel()}; head_dim / partial_rotary_factor disagree")
    configs = {id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None),
                                                                               TransformerConfig)}
    for config in configs.values():
        set_attention_factor(config, emb)
    model.rotary_pos_emb = emb
    emb.bind(model.config)
    for config in configs.values():  # every attention module must see the same factor
        check_attention_factor(config, emb.attention_factor, emb.spec)


def set_attention_factor(config, emb: ScaledRotaryEmbedding) -> None:
    """Set Megatron's `yarn_*` attributes on a TransformerConfig so that attention built from it
    multiplies cos and sin by `emb.attention_factor` (and removes them when the factor is 1)."""
    for name, value in _concentration_attrs(emb.spec, emb.attention_factor).items():
        if emb.attention_factor == 1.0:
            config.__dict__.pop(name, None)  # factor 1: Megatron's default when no yarn_* attribute exists
        else:
            setattr(config, name, value)
