"""RoPE rotation angles formed in float64: exact far out, where a float32 product of position and frequency is not.

An angle near 4e6 rad (position 4M - 1 at frequency ~1) has a float32 spacing of 0.25 rad, so a float32 product is
off by up to 0.125 rad; formed in float64 and reduced to [-pi, pi] before the one rounding to float32, it is
accurate to ~1e-7. Used by the trainer's tables
(`megatron_ext.rope`) and by the transformers engine (`megatron_ext.evaluate.hf_rope`); torch alone.
"""

from __future__ import annotations

import math

import torch


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles `[n, rot_dim/2]` float32 = positions `[n]` x inv_freq `[rot_dim/2]`, reduced to [-pi, pi] in float64.

    Below pi this is bit-identical to transformers' float32 product (the float64 product of a
    position < 2^24 and a float32 is exact, so the cast is the one rounding fp32 does).
    """
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [n, rot_dim/2]
    turns = torch.round(angles / (2 * math.pi))  # 0 for angles <= pi, so those are left untouched
    return angles.sub_(turns.mul_(2 * math.pi)).to(torch.float32)
