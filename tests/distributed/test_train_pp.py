"""Pipeline parallelism is exact: PP=2 (1F1B over gloo) continues from the same weights with the PP=1 losses."""

import json

import numpy as np
import pytest

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def run_train(torchrun, out, nproc, data, *overrides):
    log = torchrun("megatron_ext.train", nproc, "--recipe", str(RECIPE), f"checkpoint.dir={out}", f"data.prefix={data}",
             "train.seq_length=128", "train.global_batch_size=4", "train.lr=1e-2", "parallel.context=1",
             *overrides, module=True)
    (out / "log.txt").write_text(log)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def start(request, tmp_path_factory, torchrun, token_data):
    """Trained weights to start from (one step at PP=1), and the PP=1 continuation from them."""
    tied = f"model.tie_word_embeddings={str(request.param).lower()}"
    init = tmp_path_factory.mktemp("init")
    run_train(torchrun, init, 1, token_data, tied, "train.steps=1")
    pp1 = run_train(torchrun, tmp_path_factory.mktemp("pp1"), 1, token_data, tied, "train.steps=3",
                    f"checkpoint.init_from={init}")
    return tied, init, pp1


def test_pp2_losses_equal_pp1(tmp_path, torchrun, token_data, start):
    tied, init, pp1 = start
    # 4 microbatches of one sequence per step: the 1F1B schedule has warm-up, steady and cool-down phases.
    pp2 = run_train(torchrun, tmp_path, 2, token_data, tied, "train.steps=3", f"checkpoint.init_from={init}",
                    "parallel.pipeline=2")
    log = (tmp_path / "log.txt").read_text()
    assert "TP1 PP2 CP1" in log and "[train] step 3/3 loss" in log and " eta 0s" in log
    assert [m["step"] for m in pp2] == [1, 2, 3]
    np.testing.assert_allclose([m["loss"] for m in pp2], [m["loss"] for m in pp1], atol=1e-5, rtol=0)
    np.testing.assert_allclose([m["grad_norm"] for m in pp2], [m["grad_norm"] for m in pp1], rtol=1e-4)
    assert all(4.0 < m["loss"] < 7.0 for m in pp1)  # a tiny model one step into training on 512 tokens


@pytest.mark.parametrize("start", [False], ids=["untied"], indirect=True)
def test_negative_control_pp2_from_other_weights_differs(tmp_path, torchrun, token_data, start):
    tied, _, pp1 = start
    fresh = run_train(torchrun, tmp_path, 2, token_data, tied, "train.steps=1", "parallel.pipeline=2")
    assert abs(fresh[0]["loss"] - pp1[0]["loss"]) > 1e-3  # 100x the tolerance above


@pytest.mark.parametrize("start", [False], ids=["untied"], indirect=True)
def test_pp2_with_cp2_losses_equal_pp1(tmp_path, torchrun, token_data, start):
    """Pipeline messages carry the CP-local sequence: Megatron's schedule divides the given length by CP itself."""
    tied, init, pp1 = start
    both = run_train(torchrun, tmp_path, 4, token_data, tied, "train.steps=3", f"checkpoint.init_from={init}",
                     "parallel.pipeline=2", "parallel.context=2")
    assert "TP1 PP2 CP2" in (tmp_path / "log.txt").read_text()
    np.testing.assert_allclose([m["loss"] for m in both], [m["loss"] for m in pp1], atol=1e-5, rtol=0)
    np.testing.assert_allclose([m["grad_norm"] for m in both], [m["grad_norm"] for m in pp1], rtol=1e-4)
