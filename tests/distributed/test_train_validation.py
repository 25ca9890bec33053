"""Validation loss during training (train.eval_interval): transformers' loss on the valid samples is the oracle.

One CP=1 run saves a checkpoint at each validation; each is exported to Hugging Face and transformers'
`LlamaForCausalLM` computes the token-mean loss of the same valid samples (Megatron-Core's GPTDataset,
valid split). Other layouts (CP 2, DP 2, PP 2) must give the same numbers, and validating must not
change training.
"""

import json

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tests.distributed.test_train_cp import layout_line

STEPS, BATCH, EVAL_ITERS, SPLIT = 4, 2, 2, "80,20,0"


def run_train(torchrun, out, nproc, data, *overrides, recipe="cpt"):
    log = torchrun("megatron_ext.train", nproc, "--recipe", str(ROOT / f"recipes/tiny/{recipe}.yaml"),
                   f"checkpoint.dir={out}", f"data.prefix={data}", f"train.steps={STEPS}", "train.seq_length=256",
                   f"train.global_batch_size={BATCH}", "train.lr=1e-2", f"data.split={SPLIT}", *overrides, module=True)
    (out / "log.txt").write_text(log)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def validations(metrics):
    return {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}


@pytest.fixture(scope="module")
def cp1(tmp_path_factory, torchrun, token_data):
    out = tmp_path_factory.mktemp("cp1")
    metrics = run_train(torchrun, out, 1, token_data, "parallel.context=1", "train.eval_interval=2",
                        f"train.eval_iters={EVAL_ITERS}", "checkpoint.interval=2")
    return out, metrics


def hf_loss(checkpoint, step, samples, tmp_path) -> float:
    """Token-mean loss of `samples` (GPTDataset items) under transformers, from the checkpoint of `step`."""
    from transformers import LlamaForCausalLM

    from megatron_ext.convert.exporter import to_hf

    hf_dir = tmp_path / f"hf{step}"
    if not hf_dir.exists():
        to_hf(checkpoint, hf_dir, iteration=step, progress=False)
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            logits = model(torch.as_tensor(sample["tokens"])[None]).logits[0].double()  # [S, V]
            losses = torch.nn.functional.cross_entropy(logits, torch.as_tensor(sample["labels"]), reduction="none")
            total, count = total + losses.sum().item(), count + losses.numel()
    return total / count


def check_against_transformers(out, metrics, token_data, tmp_path):
    """Each validation loss of a run = transformers' loss on the first valid samples, from that step's checkpoint."""
    from megatron_ext.data import build_cpt_datasets

    assert sorted(validations(metrics)) == [2, 4]
    assert all(m["val_tokens"] == EVAL_ITERS * BATCH * 256 for m in metrics if "val_loss" in m)
    train, valid, _ = build_cpt_datasets(token_data, 256, seed=1234, split=SPLIT,
                                         num_samples=(STEPS * BATCH, EVAL_ITERS * BATCH, None))
    first = [valid[i] for i in range(EVAL_ITERS * BATCH)]
    for step, val_loss in validations(metrics).items():
        assert val_loss == pytest.approx(hf_loss(out, step, first, tmp_path), rel=1e-5), step
        assert np.exp(val_loss) == pytest.approx(next(m["val_ppl"] for m in metrics if m["step"] == step))
    return train


def test_validation_loss_is_transformers_loss_on_the_valid_samples(cp1, token_data, tmp_path):
    out, metrics = cp1
    train = check_against_transformers(out, metrics, token_data, tmp_path)
    # control: the oracle on other samples (the first training ones) is far from the validation loss
    other = hf_loss(out, 4, [train[i] for i in range(EVAL_ITERS * BATCH)], tmp_path)
    assert abs(other - validations(metrics)[4]) > 1e-3


@pytest.mark.parametrize("context", [1, 2])
def test_validation_loss_under_pipeline_parallelism(tmp_path, torchrun, token_data, context):
    """PP 2 (and PP 2 x CP 2): the forward-only pipeline schedule; its weights start elsewhere than PP 1's, so its
    own oracle."""
    metrics = run_train(torchrun, tmp_path / "run", 2 * context, token_data, f"parallel.context={context}",
                        "parallel.pipeline=2", "train.eval_interval=2", f"train.eval_iters={EVAL_ITERS}",
                        "checkpoint.interval=2")
    check_against_transformers(tmp_path / "run", metrics, token_data, tmp_path)


def test_validating_does_not_change_training(cp1, tmp_path, torchrun, token_data):
    _, metrics = cp1
    plain = run_train(torchrun, tmp_path, 1, token_data, "parallel.context=1")
    assert all("val_loss" not in m for m in plain)
    assert [m["loss"] for m in plain] == [m["loss"] for m in metrics]  # bit for bit
    assert [m["grad_norm"] for m in plain] == [m["grad_norm"] for m in metrics]


@pytest.mark.parametrize("layout", [
    ["parallel.context=2"],  # the valid sequences cut into zigzag chunks
    ["parallel.context=1"],  # 2 data-parallel replicas, one valid sample each per batch
])
def test_validation_loss_is_the_same_on_any_layout(cp1, tmp_path, torchrun, token_data, layout):
    _, reference = cp1
    metrics = run_train(torchrun, tmp_path, 2, token_data, "train.eval_interval=2", f"train.eval_iters={EVAL_ITERS}",
                        *layout)
    assert layout_line(tmp_path) == ("TP1 PP1 CP2 DP1" if "parallel.context=2" in layout else "TP1 PP1 CP1 DP2")
    got, expect = validations(metrics), validations(reference)
    assert sorted(got) == sorted(expect)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expect[s] for s in sorted(expect)], rtol=1e-5)


def test_sft_validation_loss_is_the_same_on_two_replicas(tmp_path, torchrun, sft_data):
    runs = [run_train(torchrun, tmp_path / f"dp{n}", n, sft_data, "checkpoint.init_from=null", "train.eval_interval=2",
                      "parallel.context=1", recipe="sft") for n in (1, 2)]
    one, two = (validations(m) for m in runs)
    assert sorted(one) == [2, 4] and sorted(two) == [2, 4]
    np.testing.assert_allclose([two[s] for s in (2, 4)], [one[s] for s in (2, 4)], rtol=1e-5)
    assert one[4] < one[2]  # lr 1e-2 on the train conversations lowers the held-out loss too


def test_sft_validation_loss_is_transformers_loss_on_the_held_out_conversations(tmp_path, torchrun, sft_data):
    """SFT: the valid packs' conversations run one at a time through transformers, loss on assistant tokens only
    (the loss mask), summed over both packs of the one validation batch and divided by their token count."""
    from transformers import LlamaForCausalLM

    from megatron_ext.convert.exporter import to_hf
    from megatron_ext.data import SFTPackedDataset

    out = tmp_path / "sft"
    metrics = run_train(torchrun, out, 1, sft_data, "checkpoint.init_from=null", "train.eval_interval=2",
                        "parallel.context=1", "train.steps=2", recipe="sft")
    to_hf(out, tmp_path / "hf", iteration=2, progress=False)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    valid = SFTPackedDataset(sft_data, 256, seed=1234, split=SPLIT, part=1)
    total, count = 0.0, 0
    with torch.no_grad():
        for pack in (valid[i % len(valid)] for i in range(BATCH)):
            cu = pack["cu_seqlens"].tolist()
            for a, b in zip(cu[:-1], cu[1:]):
                mask = pack["loss_mask"][a:b].bool()
                if mask.any():  # conversations (the padding tail has no loss)
                    logits = model(pack["tokens"][a:b][None]).logits[0].double()
                    losses = torch.nn.functional.cross_entropy(logits, pack["labels"][a:b], reduction="none")
                    total, count = total + losses[mask].sum().item(), count + int(mask.sum())
    assert metrics[-1]["val_tokens"] == count
    assert metrics[-1]["val_loss"] == pytest.approx(total / count, rel=1e-5)
