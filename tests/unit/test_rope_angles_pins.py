"""Pins from mutation audit round 7 of megatron_ext/rope_angles.py: an unknown precision is refused, positions past
2^24 keep their float64 accuracy, and both precisions return float32 whatever dtype inv_freq comes in."""

import math

import pytest
import torch

from megatron_ext.rope_angles import rope_angles


@pytest.mark.parametrize("precision", ["fp32", "float3", "float16", "Float64"])
def test_an_unknown_precision_is_refused_naming_the_choices(precision):
    """A value other than float64/float32 is a ValueError that names it and the two choices (mutants: silently
    float64, or anything starting 'float3' taken as float32)."""
    with pytest.raises(ValueError) as e:
        rope_angles(torch.arange(3), torch.ones(2), precision)
    assert str(e.value) == f"angle precision {precision!r}: expected one of ['float64', 'float32']"


def test_positions_past_2_to_the_24_keep_float64_accuracy():
    """Position 2^24 + 1 is not a float32 number: float64 angles are formed from the position itself, not its
    float32 rounding (2^24), which is a whole radian off at frequency 1 (mutant). Oracle: math.remainder in float64."""
    positions = torch.tensor([(1 << 24) + 1, (1 << 25) + 3])
    inv_freq = torch.tensor([1.0, 0.5, 1e-3])
    got = rope_angles(positions, inv_freq)
    want = torch.tensor([[math.remainder(p * f, 2 * math.pi) for f in inv_freq.tolist()] for p in positions.tolist()])
    assert (got.double() - want.double()).abs().max() < 1e-6


def test_both_precisions_return_float32_for_a_float64_inv_freq():
    """The angles are float32 for either precision, and float32's are the float32 product of the float32 inverse
    frequencies (transformers' rounding), also when inv_freq comes as float64 (mutant: a float64 product, not the
    phases the model is served with)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    positions = torch.tensor([0, 1, 1000, (1 << 22) - 1])
    f32 = rope_angles(positions, inv_freq, "float32")
    assert f32.dtype == torch.float32 and rope_angles(positions, inv_freq).dtype == torch.float32
    assert torch.equal(f32, positions.float()[:, None] * inv_freq.float()[None, :])
