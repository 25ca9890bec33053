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


def test_sft_gradient_is_the_token_mean_over_every_pack(tmp_path, torchrun, sft_data):
    """The gradient of a step is that of (loss summed over the assistant tokens of all 4 packs) / (their count), over
    2 ranks x 2 microbatches, as transformers computes it on the same conversations one at a time; a mean per
    microbatch (Megatron's other mode) weighs packs with few loss tokens up, and gives another gradient."""
    from transformers import LlamaForCausalLM

    from megatron_ext.convert.exporter import to_hf
    from megatron_ext.data import SFTPackedDataset

    out = tmp_path / "run"
    metrics = run_sft(torchrun, out, sft_data, "train.steps=1", "train.lr=1e-9")  # the step moves no weight by 1e-7
    to_hf(out, tmp_path / "hf", iteration=1, progress=False)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    packs = SFTPackedDataset(sft_data, 256, seed=1234)
    sums, counts = [], []
    for pack in (packs[i] for i in range(4)):
        cu, total, count = pack["cu_seqlens"].tolist(), 0.0, 0
        for a, b in zip(cu[:-1], cu[1:]):
            mask = pack["loss_mask"][a:b].bool()
            if mask.any():  # a conversation (the padding tail has no loss)
                losses = torch.nn.functional.cross_entropy(model(pack["tokens"][a:b][None]).logits[0],
                                                           pack["labels"][a:b], reduction="none")
                total, count = total + losses[mask].sum(), count + int(mask.sum())
        sums.append(total)
        counts.append(count)
    assert len(set(counts)) > 1  # packs with different numbers of loss tokens: the two weightings differ

    def grad_norm(loss) -> float:
        model.zero_grad()
        loss.backward(retain_graph=True)
        return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))

    token_mean = grad_norm(sum(sums) / sum(counts))
    per_pack_mean = grad_norm(sum(s / c for s, c in zip(sums, counts)) / 4)
    assert metrics[0]["grad_norm"] == pytest.approx(token_mean, rel=1e-4)
    assert abs(per_pack_mean / token_mean - 1) > 1e-2  # the control: the other weighting is far outside that
