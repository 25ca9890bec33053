"""RoPE rotation angles, position x inverse frequency, in one of two precisions.

`float64` (the default): formed in float64 and reduced to [-pi, pi] before the one rounding to float32. An angle
near 4e6 rad (position 4M - 1 at frequency ~1) has a float32 spacing of 0.25 rad, so a float32 product is off by up
to 0.125 rad; this one is accurate to ~1e-7.

`float32`: the float32 product, as transformers, vLLM and stock Megatron-Core form it (and so as the paper's models
were trained and as every serving engine runs them): a model trained this way meets at serving time exactly the
phases it was trained with, rounding included.

The choice is `rope.angle_precision` in a recipe and `rope_angle_precision` (absent: float64) in the HF config dict
that travels with checkpoints and exports. Used by the trainer's tables (`megatron_ext.rope`) and by the
transformers engine (`megatron_ext.evaluate.hf_rope`); torch alone.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.rope_spec import ANGLE_PRECISIONS


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, precision: str = "float64") -> torch.Tensor:
    """Angles `[n, rot_dim/2]` float32 = positions `[n]` x inv_freq `[rot_dim/2]`, formed in `precision`.

    float64: reduced to [-pi, pi] in float64, then rounded once. Below pi this is bit-identical to the float32
    product (the float64 product of a position < 2^24 and a float32 is exact, so the cast is the one rounding
    fp32 does). float32: that product everywhere, unreduced, bit for bit transformers' `inv_freq @ position_ids`.
    """
    if precision == "float32":
        return positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    if precision != "float64":
        raise ValueError(f"angle precision {precision!r}: expected one of {list(ANGLE_PRECISIONS)}")
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [n, rot_dim/2]
    turns = torch.round(angles / (2 * math.pi))  # 0 for angles <= pi, so those are left untouched
    return angles.sub_(turns.mul_(2 * math.pi)).to(torch.float32)
