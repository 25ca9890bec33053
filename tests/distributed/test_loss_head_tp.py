"""The chunked loss head on TP=2 gloo ranks: against a float64 oracle, and in the model against TP=1."""

import pytest

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/loss_head_tp.py"
MODEL_WORKER = ROOT / "tests/distributed/workers/tp_loss.py"


@pytest.mark.parametrize("flags", [(), ("--sequence-parallel",)], ids=["tp2", "tp2-sp"])
def test_tp2_chunked_head_matches_float64_oracle(tmp_path, torchrun, flags):
    """Labels include each slice's first and last vocabulary rows (0, V/2-1, V/2, V-1). Under sequence
    parallelism no chunk gathers more than chunk_tokens rows from the TP ranks (chunk_tokens / TP from each)."""
    torchrun(WORKER, 2, "--out", str(tmp_path / "out.json"), *flags)
    out = read_json(tmp_path / "out.json")
    ranks = out["ranks"]
    assert len(ranks) == 2
    for errors in ranks:
        assert max(errors.values()) < 1e-5, errors
    for rows in out["gathered_rows"]:
        if flags:
            assert rows and max(rows) <= out["chunk_tokens"], rows
        else:
            assert rows == [], rows


def test_negative_control_wrong_vocab_slice_is_caught(tmp_path, torchrun):
    torchrun(WORKER, 2, "--out", str(tmp_path / "out.json"), "--wrong-slice")
    assert all(max(e.values()) > 0.1 for e in read_json(tmp_path / "out.json")["ranks"])


def test_tp2_chunked_model_equals_tp1_megatron_head(tmp_path, torchrun):
    """Same weights: TP=1 with Megatron's loss head, TP=2 with the chunked head (chunks of 24 of 128 tokens)."""
    torchrun(MODEL_WORKER, 1, "--tp", "1", "--loss-head", "full", "--save", str(tmp_path / "ckpt"),
             "--out", str(tmp_path / "full.json"))
    torchrun(MODEL_WORKER, 2, "--tp", "2", "--loss-chunk-tokens", "24", "--load", str(tmp_path / "ckpt"),
             "--out", str(tmp_path / "chunked.json"))
    full, chunked = read_json(tmp_path / "full.json"), read_json(tmp_path / "chunked.json")
    assert full["split_grad_norm"] > 0
    assert abs(full["loss"] - chunked["loss"]) < 1e-5, (full, chunked)
    # Every split weight counts once at TP=1 and once (its two halves) at TP=2.
    assert abs(full["split_grad_norm"] - chunked["split_grad_norm"]) < 1e-5 * full["split_grad_norm"], (full, chunked)


def test_tp2_logits_in_the_hundreds_match_the_oracle(tmp_path, torchrun):
    """Logits up to ~450 (output weight x 60): each token's logits are shifted by the maximum over the TP ranks
    before exp, so no rank's exp underflows to a sum of 0 (mutant, the ranks' maxima summed: shifted by ~2 x the
    maximum, an infinite loss and NaN gradients). Errors relative to the largest logit (fp32 of values ~450)."""
    torchrun(WORKER, 2, "--out", str(tmp_path / "out.json"), "--logit-scale", "60")
    out = read_json(tmp_path / "out.json")
    assert out["max_logit"] > 200, out
    for errors in out["ranks"]:
        assert all(e < 1e-5 * out["max_logit"] for e in errors.values()), errors
