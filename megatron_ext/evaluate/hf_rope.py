"""RoPE angles for the transformers engine, computed the way the trainer computed them.

transformers' Llama multiplies each position by the inverse frequencies in float32. Near 4M tokens an angle of
~4e6 rad has a float32 spacing of 0.25 rad, so the fastest-turning pairs are off by up to 0.125 rad: positions the
model never saw in training when it trained with float64 angles (our default), where
`megatron_ext.rope_angles.rope_angles` forms position x inv_freq in float64 and reduces it modulo 2 pi before
rounding to float32. `rope_angles_as_trained(model)` wraps the model's rotary embedding in a module that does the
same, unless the model's config says it trained with float32 angles (`rope_angle_precision: float32`): then
transformers' own product is the training's, bit for bit, and the model is left as it is. The inverse frequencies
and the attention factor stay transformers' own (dynamic and longrope update theirs for each sequence length).
"""

from __future__ import annotations

import torch

from megatron_ext.rope_angles import rope_angles
from megatron_ext.rope_spec import ANGLE_PRECISION_KEY, angle_precision

# rope types whose inverse frequencies transformers updates in the rotary module's forward (by sequence length)
_UPDATED_IN_FORWARD = ("dynamic", "longrope")


class Float64RotaryAngles(torch.nn.Module):
    """A transformers rotary embedding (`inner`: `forward(x, position_ids)` -> cos, sin `[b, s, head_dim]`) whose
    angles are formed in float64 and reduced modulo 2 pi before float32; the same contract as `inner`."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if any(kind in str(getattr(self.inner, "rope_type", "")) for kind in _UPDATED_IN_FORWARD):
            self.inner(x, position_ids)  # lets transformers pick the frequencies for this length
        inv_freq = self.inner.inv_freq.to(x.device)
        angles = rope_angles(position_ids.reshape(-1).to(x.device), inv_freq)  # [b * s, head_dim / 2] float32
        emb = torch.cat((angles, angles), dim=-1).view(*position_ids.shape, -1)  # Llama's half-split layout
        scale = self.inner.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def rope_angles_as_trained(model: torch.nn.Module) -> str | None:
    """Make a transformers Llama-style model (`model.model.rotary_emb`) form RoPE angles as its training did.

    Returns the precision it now uses: "float32" (its config's `rope_angle_precision`: transformers' own product,
    left as it is) or "float64" (the rotary embedding wrapped in `Float64RotaryAngles`, once); None where the model
    has no rotary embedding of that form (then it is left as it is).
    """
    body = getattr(model, "model", None)
    rotary = getattr(body, "rotary_emb", None)
    if isinstance(rotary, Float64RotaryAngles):
        return "float64"
    if not (isinstance(rotary, torch.nn.Module) and hasattr(rotary, "inv_freq") and hasattr(rotary, "attention_scaling")):
        return None
    precision = angle_precision({ANGLE_PRECISION_KEY: getattr(getattr(model, "config", None), ANGLE_PRECISION_KEY,
                                                              None)})
    if precision == "float32":
        return precision
    body.rotary_emb = Float64RotaryAngles(rotary)
    return precision
