"""TP=2 on two gloo processes computes the same loss as TP=1 on the same weights."""

import pytest

from tests.conftest import ROOT, read_json

WORKER = ROOT / "tests/distributed/workers/tp_loss.py"


@pytest.fixture(scope="module")
def tp1(tmp_path_factory, torchrun):
    d = tmp_path_factory.mktemp("tp")
    torchrun(WORKER, 1, "--tp", "1", "--save", str(d / "ckpt"), "--out", str(d / "tp1.json"))
    return d


def test_tp2_loss_equals_tp1(tp1, torchrun):
    """... and so does the gradient of the TP-split weights (the norm over their slices on both ranks)."""
    torchrun(WORKER, 2, "--tp", "2", "--load", str(tp1 / "ckpt"), "--out", str(tp1 / "tp2.json"))
    one, two = read_json(tp1 / "tp1.json"), read_json(tp1 / "tp2.json")
    assert abs(one["loss"] - two["loss"]) < 1e-5, (one, two)
    assert abs(one["split_grad_norm"] / two["split_grad_norm"] - 1) < 1e-5, (one, two)


def test_negative_control_changed_weight_changes_loss(tp1, torchrun):
    torchrun(WORKER, 2, "--tp", "2", "--load", str(tp1 / "ckpt"), "--perturb", "--out", str(tp1 / "bad.json"))
    one, bad = read_json(tp1 / "tp1.json"), read_json(tp1 / "bad.json")
    assert abs(one["loss"] - bad["loss"]) > 1e-4, (one, bad)
    assert abs(one["split_grad_norm"] / bad["split_grad_norm"] - 1) > 1e-4, (one, bad)
