"""SFT through the trainer: packed conversations, loss only on assistant tokens, exact token mean over DP."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/sft.yaml"


def run_sft(torchrun, out, data, *overrides):
    torchrun("megatron_ext.train", 2, "--recipe", str(RECIPE), f"checkpoint.dir={out}", f"data.prefix={data}",
             "checkpoint.init_from=null", "train.steps=3", "train.global_batch_size=4", "train.lr=3e-3", *overrides,
             module=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, torchrun, sft_data):
    return run_sft(torchrun, tmp_path_factory.mktemp("dp2"), sft_data)


def test_sft_two_ranks(dp2, sft_data):
    from megatron_ext.cost_model import shape_from_hf_config, train_flops, train_flops_per_token
    from megatron_ext.data import SFTPackedDataset
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.recipe import load_recipe

    metrics = dp2
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The loss is averaged over exactly the assistant tokens of the 4 packs of each step, over both ranks.
    packs = SFTPackedDataset(sft_data, 256, seed=1234)
    shape = shape_from_hf_config(hf_config_from_recipe(load_recipe(RECIPE)))
    for step, m in enumerate(metrics):
        rows = [packs[(step * 4 + i) % len(packs)] for i in range(4)]
        assert m["loss_tokens"] == sum(int(r["loss_mask"].sum()) for r in rows)
        # TFLOP/s: causal attention within each conversation (and the padding tail), not over the whole pack
        lengths = torch.cat([r["cu_seqlens"][1:] - r["cu_seqlens"][:-1] for r in rows]).long()
        assert len(lengths) > 4  # several conversations per pack
        pairs = int((lengths * (lengths + 1) // 2).sum())
        assert m["tflops_per_device"] == pytest.approx(train_flops(shape, 4 * 256, pairs) / m["step_time_s"] / 2 / 1e12)
        whole_packs = 4 * 256 * train_flops_per_token(shape, 256)
        assert train_flops(shape, 4 * 256, pairs) < 0.99 * whole_packs  # the count before: 4% more here
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.parametrize("overrides", [["train.loss_head=full"], ["parallel.tensor=2", "train.loss_chunk_tokens=100"]],
                         ids=["megatron-head", "tp2-chunks"])
def test_sft_losses_equal_with_megatron_head_and_at_tp2(tmp_path, torchrun, sft_data, dp2, overrides):
    """Packed (THD) samples through the chunked head: the same per-step losses as Megatron's head, and as TP=2
    (each pack whole on both ranks, 100-token chunks) instead of DP=2."""
    metrics = run_sft(torchrun, tmp_path, sft_data, *overrides)
    assert [m["loss_tokens"] for m in metrics] == [m["loss_tokens"] for m in dp2]
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in dp2], atol=1e-5, rtol=0)
