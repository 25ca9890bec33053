"""The planner's memory of the torch SDPA backend under context parallelism against what real CP ranks keep.

The backend all-gathers K and V of the whole sequence in every layer (megatron_ext/attention.py) and SDPA keeps
them for backward: CP times the rank's own K and V. Measured on gloo CP groups (workers/plan_memory_cp.py): the
bytes the decoder layers save in one forward (storages, parameters left out; torch's CPU-only materialised
lower-right causal mask reported apart) and the peak of one layer's core-attention backward, against
`megatron_ext.plan.plan(...)` for the same recipe.

Measured (fp32, 2 layers, 1024 tokens per rank): CP 1 13,287,424 B; CP 2 (L 2048) 13,549,568 B on both ranks,
predicted 13,549,568; the K/V-heavy shape below at CP 4 (L 4096) 18,399,232 B, predicted 18,399,232, where the
formula without the gathered K/V (the CP 1 itemisation) predicts 13,156,352 (-28.5%).
"""

import json

import pytest

from megatron_ext import cost_model as C
from megatron_ext import plan as P
from megatron_ext.recipe import load_recipe
from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/plan_memory_cp.py"
TOLERANCE = 0.25  # as tests/unit/test_plan_memory.py
# MHA, head dim 32, FC1 64: the gathered K/V's share of a layer at CP 4 is about that of Llama-3.1-8B at TP 8, CP 64
# (no sequence parallelism), where leaving it out predicts 0.69 x the layer (0.715 x here)
KV_HEAVY = ["model.num_key_value_heads=4", "model.head_dim=32", "model.intermediate_size=64"]
CASES = [{"cp": 1, "seq": 1024}, {"cp": 2, "seq": 2048}, {"cp": 4, "seq": 4096, "set": KV_HEAVY}]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, torchrun):
    out = tmp_path_factory.mktemp("plan_cp") / "measured.json"
    torchrun(WORKER, 4, "--out", str(out), "--cases", json.dumps(CASES))
    return {(case[0]["cp"], case[0]["seq"]): case for case in read_json(out)}


def _plan(cp: int, seq: int, overrides: list[str] = ()):
    recipe = load_recipe("recipes/tiny/base.yaml", [
        f"train.seq_length={seq}", f"model.max_position_embeddings={seq}", "train.recompute=none",
        f"parallel.context={cp}", f"cluster.gpus_per_node={cp}", "train.global_batch_size=1", *overrides])
    assert P.kernels_of(recipe) == "local"
    return recipe, P.plan(recipe, C.GPUS["h100-80gb"], cp)


def test_saved_for_backward_at_cp2_counts_the_gathered_kv(measured):
    cp1, ranks = measured[1, 1024][0]["saved"], measured[2, 2048]
    _, p = _plan(2, 2048)
    for r in ranks:
        saved = r["saved"] - r["mask"]
        print(f"CP 2 rank {r['cp_rank']}: saved {saved:,} B (+ CPU mask {r['mask']:,}), predicted "
              f"{p.memory.activations:,.0f}; CP 1 at the same tokens per rank {cp1:,}")
        assert abs(p.memory.activations / saved - 1) < TOLERANCE, (p.memory.activations, saved)
        # the whole sequence's K and V (CP x the rank's) in place of the rank's QKV buffer and rotated K, and the
        # chunks' outputs concatenated for the projection: (2 CP - 3) x the rank's K more per layer, counted exactly
        assert saved == p.memory.activations and saved > cp1


def test_gathered_kv_left_out_misses_by_more_than_the_tolerance(measured):
    recipe, p = _plan(4, 4096, KV_HEAVY)
    s, tokens = C.Shape.from_recipe(recipe), 4096 // 4
    old = C.activation_bytes(s, tokens, s.layers, "none", 1, True, 4.0, "local", unfused_rope=True)
    for r in measured[4, 4096]:
        saved = r["saved"] - r["mask"]
        print(f"CP 4 K/V-heavy rank {r['cp_rank']}: saved {saved:,} B, predicted {p.memory.activations:,.0f}, "
              f"without gathered K/V {old:,.0f} ({old / saved - 1:+.1%})")
        assert abs(p.memory.activations / saved - 1) < TOLERANCE
        assert abs(old / saved - 1) > TOLERANCE  # negative control: the CP 1 formula


@pytest.mark.parametrize("cp, seq, overrides", [(2, 2048, []), (4, 4096, KV_HEAVY)])
def test_backward_transient_of_the_gathered_kv(measured, cp, seq, overrides):
    """One layer's core-attention backward: gradients of the whole sequence's K and V, padded per chunk and per
    piece before they are summed and reduce-scattered."""
    recipe, p = _plan(cp, seq, overrides)
    s = C.Shape.from_recipe(recipe)
    ring = C.cp_buffer_bytes(s, seq // cp, 1, cp, 4.0, "te")  # what the planner counted before: TE's p2p buffers
    for r in measured[cp, seq]:
        peak = r["attn_backward_peak"]
        print(f"CP {cp} rank {r['cp_rank']}: attention backward peak {peak:,} B, predicted {p.memory.cp_buffers:,.0f}"
              f" (TE ring formula {ring:,.0f})")
        assert abs(p.memory.cp_buffers / peak - 1) < TOLERANCE, (p.memory.cp_buffers, peak)
        if cp == 4:
            assert abs(ring / peak - 1) > TOLERANCE  # negative control (at CP 2 it happens to be close)
