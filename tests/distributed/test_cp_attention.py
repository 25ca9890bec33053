"""The torch SDPA backend under context parallelism on real gloo CP groups (workers/cp_attention.py): each rank's
zigzag part of the outputs and of the Q/K/V gradients equals SDPA over the whole unsharded sequence, causal and
unmasked, at CP 4 and at CP 2 (two CP groups, so a group rank is not the global rank). The unit tests check the
per-chunk math (tests/unit/test_cp_attention.py); this one the all-gather, its reduce-scatter backward, the reorder
into global order and the rank the chunks are chosen by."""

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/cp_attention.py"


def test_cp_core_attention_equals_sdpa_over_the_whole_sequence(tmp_path, torchrun):
    torchrun(WORKER, 4, "--out", str(tmp_path / "cp_attention.json"))
    results = read_json(tmp_path / "cp_attention.json")
    assert [(r["cp"], r["kind"]) for r in results] == [(4, "causal"), (4, "no_mask"), (2, "causal"), (2, "no_mask")]
    for r in results:
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < 1e-12, r
