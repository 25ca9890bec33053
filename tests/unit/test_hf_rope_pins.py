"""The transformers engine's float64 RoPE angles (megatron_ext.evaluate.hf_rope) against transformers' own rotary
module on what tests/unit/test_evaluate.py does not try (mutation audit round 7): a batch whose rows have other
positions (prefill chunks, shared-prefix batches), a bf16 model (cos/sin in the model's dtype), and models it must
leave alone."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_ext.evaluate.hf_rope import rope_angles_as_trained
from megatron_ext.presets import TINY


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**dict(TINY, max_position_embeddings=512)))


def test_a_batch_of_other_positions_per_row_matches_transformers():
    """Angles below 300 rad: transformers' float32 values within float32 spacing (the oracle), row by row."""
    model = _model()
    rotary = model.model.rotary_emb
    positions = torch.stack([torch.arange(0, 40), torch.arange(200, 240)])  # [2, 40]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(2, 1, dtype=dtype)
        want = rotary(x, positions)
        assert rope_angles_as_trained(model) == "float64"
        got = model.model.rotary_emb(x, positions)
        for g, w in zip(got, want):
            assert g.shape == w.shape == (2, 40, rotary.inv_freq.numel() * 2) and g.dtype == w.dtype == dtype
            torch.testing.assert_close(g.float(), w.float(), atol=2e-5 if dtype == torch.float32 else 8e-3, rtol=0)


def test_models_without_a_llama_rotary_module_are_left_alone():
    class NoScaling(torch.nn.Module):  # a rotary module of another form: inv_freq, no attention_scaling
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4))

    model = _model()
    model.model.rotary_emb = odd = NoScaling()
    assert rope_angles_as_trained(model) is None and model.model.rotary_emb is odd
    assert rope_angles_as_trained(torch.nn.Linear(2, 2)) is None  # no .model at all


def test_dynamic_frequencies_follow_the_sequence_length():
    """Dynamic NTK: transformers sets the frequencies for each call's length in the rotary module's forward; the
    float64 angles must use those of this call (the oracle: a fresh transformers module given the same positions),
    beyond max_position_embeddings and back within it."""
    cfg = dict(TINY, max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    ours, theirs = LlamaForCausalLM(LlamaConfig(**cfg)), LlamaForCausalLM(LlamaConfig(**cfg))
    assert rope_angles_as_trained(ours) == "float64"
    x = torch.zeros(1, 1)
    for positions in (torch.arange(0, 300)[None], torch.arange(0, 20)[None]):
        want, got = theirs.model.rotary_emb(x, positions), ours.model.rotary_emb(x, positions)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
