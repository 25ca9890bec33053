"""SFT through the trainer: packed conversations, loss only on assistant tokens, exact token mean over DP."""

import json

import torch

from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/sft.yaml"


def test_sft_two_ranks(tmp_path, torchrun, sft_data):
    from megatron_ext.data import SFTPackedDataset

    torchrun("megatron_ext.train", 2, "--recipe", str(RECIPE), f"checkpoint.dir={tmp_path}",
             f"data.prefix={sft_data}", "checkpoint.init_from=null", "train.steps=3", "train.global_batch_size=4",
             "train.lr=3e-3", module=True)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The loss is averaged over exactly the assistant tokens of the 4 packs of each step, over both ranks.
    packs = SFTPackedDataset(sft_data, 256, seed=1234)
    for step, m in enumerate(metrics):
        expected = sum(int(packs[(step * 4 + i) % len(packs)]["loss_mask"].sum()) for i in range(4))
        assert m["loss_tokens"] == expected
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
