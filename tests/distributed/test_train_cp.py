"""Context parallelism is exact: CP=2, CP=4 and TP=2 x CP=2 give the CP=1 losses, step by step; so does
Megatron's own loss head in place of the chunked one (the recipes' default)."""

import json

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.unit.test_train_profile import check_trace

RECIPE = ROOT / "recipes/tiny/cpt.yaml"
STEPS = 3


def run_train(torchrun, out, nproc, data, *overrides):
    log = torchrun("megatron_ext.train", nproc, "--recipe", str(RECIPE), f"checkpoint.dir={out}", f"data.prefix={data}",
                   f"train.steps={STEPS}", "train.seq_length=256", "train.global_batch_size=2", "train.lr=1e-2",
                   *overrides, module=True)
    (out / "log.txt").write_text(log)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def layout_line(out) -> str:
    """The trainer's `TP.. PP.. CP.. DP..` words: DP is the size of Megatron's own data-parallel group, so CP2 DP1
    on 2 processes shows the context split really happened (a CP the trainer ignored would be DP2)."""
    line = next(x for x in (out / "log.txt").read_text().splitlines() if "] [train] " in x and " TP" in x)
    return " ".join(w for w in line.replace(",", "").split() if w[:2] in ("TP", "PP", "CP", "DP") and w[2:].isdigit())


@pytest.fixture(scope="module")
def cp1(tmp_path_factory, torchrun, token_data):
    return run_train(torchrun, tmp_path_factory.mktemp("cp1"), 1, token_data, "parallel.context=1")


def check_throughput(metrics, world: int) -> None:
    """tokens/s and TFLOP/s per device as the trainer logs them: a global batch of 2 x 256 tokens per step, and the
    cost model's training FLOPs per token (checked against perf.md's formula and NVIDIA's tables in test_plan.py)
    spread over every process."""
    from megatron_ext.cost_model import shape_from_hf_config, train_flops_per_token
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    shape = shape_from_hf_config(hf_config_from_recipe(load_recipe(RECIPE, ["train.seq_length=256"])))
    per_token = train_flops_per_token(shape, 256)
    for m in metrics:
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(2 * 256)
        assert m["tflops_per_device"] == pytest.approx(per_token * 2 * 256 / m["step_time_s"] / world / 1e12)
        assert "mfu" not in m  # no GPU peak on a CPU


def losses(metrics):
    return [m["loss"] for m in metrics]


@pytest.mark.parametrize("nproc, layout", [
    (2, ["parallel.context=2", "profile.steps=[2,3]", "profile.ranks=[0,1]"]),  # traced: the same losses
    (4, ["parallel.context=4", "parallel.cp_comm_type=all_gather"]),
    (4, ["parallel.context=2", "parallel.tensor=2", "train.loss_chunk_tokens=48"]),
    (1, ["parallel.context=1", "train.loss_head=full"]),
])
def test_cp_losses_equal_cp1(tmp_path, torchrun, token_data, cp1, nproc, layout):
    metrics = run_train(torchrun, tmp_path, nproc, token_data, *layout)
    tp = 2 if "parallel.tensor=2" in layout else 1
    cp = int(next(o for o in layout if o.startswith("parallel.context=")).split("=")[1])
    assert layout_line(tmp_path) == f"TP{tp} PP1 CP{cp} DP{nproc // (tp * cp)}"
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert losses(metrics)[0] > 5.0  # untrained tiny model on random tokens: about ln(512)
    np.testing.assert_allclose(losses(metrics), losses(cp1), atol=1e-5, rtol=0)
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in cp1], rtol=1e-4)
    check_throughput(metrics, nproc)
    if "profile.steps=[2,3]" in layout:  # each CP rank's trace of steps 2 and 3 (tests/unit/test_train_profile.py)
        for rank in (0, 1):
            check_trace(tmp_path / "profile", rank, 2, 3, STEPS)


def test_training_reduces_loss(cp1):
    assert losses(cp1)[-1] < losses(cp1)[0]


def test_negative_control_different_data_order_differs(tmp_path, torchrun, token_data, cp1):
    metrics = run_train(torchrun, tmp_path, 1, token_data, "parallel.context=1", "train.seed=99")
    assert abs(losses(metrics)[0] - losses(cp1)[0]) > 1e-4  # 10x the tolerance above


def test_blend_of_two_datasets_at_cp2_equals_cp1(tmp_path, torchrun, token_data, second_token_data, cp1):
    """data.prefix as a list with data.weights (Megatron-Core's BlendedDataset) through the whole loop."""
    blend = [f"data.prefix=[{token_data}, {second_token_data}]", "data.weights=[3, 1]"]  # after run_train's prefix
    one = run_train(torchrun, tmp_path / "cp1", 1, token_data, "parallel.context=1", *blend)
    two = run_train(torchrun, tmp_path / "cp2", 2, token_data, "parallel.context=2", *blend)
    assert layout_line(tmp_path / "cp2") == "TP1 PP1 CP2 DP1"
    np.testing.assert_allclose(losses(two), losses(one), atol=1e-5, rtol=0)
    assert abs(losses(one)[0] - losses(cp1)[0]) > 1e-4  # control: the blend reads other samples than token_data
