"""What the trainer reads: how data.split divides documents (CPT) and conversations (SFT) for train.eval_interval,
blends of several CPT datasets (data.prefix list + data.weights), and microbatches on the model's device.

Oracle for the document ranges and the blend: Megatron-Core's own GPTDataset and BlendedDataset.
"""

import numpy as np
import pytest
import torch

from megatron_ext.data import DataError, SFTPackedDataset, build_cpt_datasets, read_manifest
from megatron_ext.data.common import split_fractions, split_range
from megatron_ext.recipe import load_recipe
from megatron_ext.training_data import build_batches, build_datasets
from tests.conftest import ROOT


@pytest.mark.parametrize("split, expect", [
    ("98,2,0", (0.98, 0.02, 0.0)), ("98/2/0", (0.98, 0.02, 0.0)), ("3, 1", (0.75, 0.25, 0.0)),
    ("1", (1.0, 0.0, 0.0)), ("0.5,0.25,0.25", (0.5, 0.25, 0.25)),
])
def test_split_fractions(split, expect):
    assert split_fractions(split) == pytest.approx(expect, abs=1e-15)


@pytest.mark.parametrize("split", ["", "abc", "0,1,0", "1,2,3,4", "98,-2,0", "98,,2", "nan,1"])
def test_split_fractions_refuses(split):
    with pytest.raises(DataError, match=r"data\.split = .*: expected train,valid,test weights"):
        split_fractions(split)


@pytest.mark.parametrize("split", ["80,20,0", "98,2,0", "70,20,10", "33,33,34"])
def test_document_ranges_are_megatrons(token_data, split):
    """split_range (used for SFT conversations) = the documents Megatron-Core's GPTDataset puts in each split."""
    documents = read_manifest(token_data, "cpt")["documents"]
    datasets = build_cpt_datasets(token_data, 64, split=split)
    for part, dataset in enumerate(datasets):
        expect = list(split_range(documents, split, part))
        got = [] if dataset is None else sorted(np.unique(dataset.indices).tolist())
        assert got == expect, (split, part)
    # control: a split of other weights gives other ranges
    assert list(split_range(documents, "90,10,0", 1)) != list(split_range(documents, split, 1))


def test_sft_splits_hold_disjoint_conversations(sft_data):
    whole = SFTPackedDataset(sft_data, 256, seed=3)
    train = SFTPackedDataset(sft_data, 256, seed=3, split="80,20,0", part=0)
    valid = SFTPackedDataset(sft_data, 256, seed=3, split="80,20,0", part=1)
    convs = {name: sorted(i for pack in ds.packs for i in pack) for name, ds in
             (("whole", whole), ("train", train), ("valid", valid))}
    n = len(whole.tokens)
    assert set(convs["valid"]) <= set(split_range(n, "80,20,0", 1)) and convs["valid"]
    assert set(convs["train"]) <= set(split_range(n, "80,20,0", 0))
    assert sorted(convs["train"] + convs["valid"]) == convs["whole"]  # each kept conversation once
    # a valid pack's tokens are its conversations' tokens (the split reads the same data, not a copy)
    first = valid[0]
    k = valid.packs[0][0]
    assert first["tokens"][:len(valid.tokens[k])].tolist() == valid.tokens[k].tolist()


def test_sft_split_leaving_valid_empty_is_an_error(sft_data):
    with pytest.raises(DataError, match=r"data\.split = '99\.9,0\.1,0': leaves the valid split of data prefix .* "
                                        r"empty; give it a larger weight"):
        SFTPackedDataset(sft_data, 256, split="99.9,0.1,0", part=1)


def _recipe(data, stage="cpt", *overrides):
    recipe = ROOT / ("recipes/tiny/cpt.yaml" if stage == "cpt" else "recipes/tiny/sft.yaml")
    data = f"[{', '.join(data)}]" if isinstance(data, list) else data
    return load_recipe(recipe, [f"data.prefix={data}", "checkpoint.dir=/tmp/unused", "checkpoint.init_from=null",
                                "train.seq_length=256", "train.steps=8", "parallel.context=1",
                                "train.global_batch_size=2", *overrides])


def test_validation_batches_read_the_valid_split_from_its_start(token_data):
    recipe = _recipe(token_data, "cpt", "data.split=80,20,0", "train.eval_interval=4", "train.eval_iters=3")
    train, valid = build_batches(recipe, dp_rank=1, dp_size=2, cp_rank=0, cp_size=1, first_step=5,
                                 consumed_samples=10)
    assert len(valid.dataset) >= 3 * 2
    assert [valid.sample_ids(k, 0) for k in range(3)] == [[1], [3], [5]]  # DP rank 1 of 2: every second sample
    assert train.sample_ids(5, 0) == [11]  # training resumes where it was
    documents = read_manifest(token_data, "cpt")["documents"]
    assert set(np.unique(valid.dataset.indices)) <= set(split_range(documents, "80,20,0", 1))
    assert set(np.unique(train.dataset.indices)) <= set(split_range(documents, "80,20,0", 0))
    batch = valid.microbatch(0, 0)
    assert batch["tokens"].shape == (1, 256) and torch.equal(batch["tokens"][0], valid.dataset[1]["tokens"])
    assert build_batches(_recipe(token_data), 0, 1, 0, 1)[1] is None  # no validation: no valid dataset


@pytest.mark.parametrize("stage", ["cpt", "sft"])
def test_microbatches_go_to_the_models_device(token_data, sft_data, stage):
    """On a GPU the batches must reach the model's device (they did not: the loop had never run on CUDA).
    The meta device stands in for CUDA here; tests/gpu/test_train_cuda.py runs the loop on a GPU."""
    recipe = _recipe(token_data if stage == "cpt" else sft_data, stage, "data.split=80,20,0", "train.eval_interval=4")
    for batches in build_batches(recipe, 0, 2, 0, 1, device="meta"):
        batch = batches.microbatch(0, 0)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if stage == "sft":
            tensors["cu_seqlens"] = batch["packed_seq_params"].cu_seqlens_q
        assert set(tensors) >= {"tokens", "labels", "loss_mask", "position_ids"}
        assert {k: v.device.type for k, v in tensors.items()} == {k: "meta" for k in tensors}


@pytest.mark.parametrize("split, eval_interval, message", [
    # Megatron-Core's GPTDataset would loop forever over these splits of no tokens
    ("99.9,0.1,0", 2, r"the valid split of data prefix .* holds 0 of 120 documents, 0 tokens, fewer than one sequence "
                      r"of seq_length 256 needs \(257\); give it a larger weight or set its weight to 0 and "
                      r"train\.eval_interval=0"),
    ("99.9,0.1,0", 0, r"the valid split .* holds 0 of 120 documents"),  # built even when nothing reads it
    ("99.9,0,0.1", 0, r"the test split .* holds 0 of 120 documents, 0 tokens, .* or set its weight to 0$"),
    ("1,999", 0, r"the train split .* holds 0 of 120 documents, 0 tokens, .* give it a larger weight$"),
])
def test_split_too_small_for_a_sequence_is_an_error(token_data, split, eval_interval, message):
    recipe = _recipe(token_data, "cpt", f"data.split={split}", f"train.eval_interval={eval_interval}")
    with pytest.raises(DataError, match=rf"data\.split = '{split}': {message}"):
        build_datasets(recipe, 16, validation=eval_interval > 0)


def test_sft_validation_dataset(sft_data):
    recipe = _recipe(sft_data, "sft", "data.split=80,20,0", "train.eval_interval=2", "train.global_batch_size=2")
    train, valid = build_datasets(recipe, 16, validation=True)
    assert {i for p in train.packs for i in p}.isdisjoint({i for p in valid.packs for i in p})


def test_sft_validation_reads_the_same_packs_in_the_same_order_every_pass(sft_data):
    """Validation goes round its few packs in their own order each time (a loss comparable from one validation to the
    next, and with another run's), while training goes round its packs in a new order each pass."""
    recipe = _recipe(sft_data, "sft", "data.split=80,20,0", "train.eval_interval=2", "train.eval_iters=30")
    train, valid = build_batches(recipe, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    n = len(valid.dataset)
    assert 30 * 2 > 2 * n  # more than two passes over the valid packs
    assert [i for k in range(30) for m in range(2) for i in valid.sample_ids(k, m)] == [s % n for s in range(60)]
    t = len(train.dataset)
    assert [train.pack_of(s) for s in range(t, 2 * t)] != list(range(t))  # control: training's second pass


def test_sft_needs_one_global_batch_of_packs(sft_data):
    """As many packs as train.global_batch_size are enough (each step reads every pack once); one fewer is an
    error naming the counts and the fix."""
    def recipe(batch):  # one process: any global batch divides
        return _recipe(sft_data, "sft", "cluster.gpus_per_node=1", f"train.global_batch_size={batch}")

    packs = len(build_datasets(recipe(2), 0, validation=False)[0])
    assert len(build_datasets(recipe(packs), 0, validation=False)[0]) == packs
    with pytest.raises(DataError, match=rf"^data\.prefix = '{sft_data}': {packs} packed sequences of 256 tokens, "
                                        rf"fewer than train\.global_batch_size = {packs + 1}; prepare more SFT data "
                                        "or lower the global batch$"):
        build_datasets(recipe(packs + 1), 0, validation=False)


@pytest.mark.parametrize("weights, expect", [("[3, 1]", [12, 4]), ("[1, 1]", [8, 8])])
def test_blend_reads_the_prefixes_by_weight(token_data, second_token_data, weights, expect):
    """data.prefix as a list with data.weights: Megatron-Core's BlendedDataset, 16 training samples split by weight,
    each the sample of the dataset it names; validation blends the valid splits alike."""
    recipe = _recipe([token_data, second_token_data], "cpt", f"data.weights={weights}", "data.split=80,20,0",
                     "train.eval_interval=2", "train.eval_iters=4")
    train, valid = build_datasets(recipe, 16, validation=True)
    assert np.bincount(train.dataset_index[:16], minlength=2).tolist() == expect
    for i in range(16):
        own = train.datasets[train.dataset_index[i]][train.dataset_sample_index[i]]
        assert torch.equal(torch.as_tensor(train[i]["tokens"]), torch.as_tensor(own["tokens"]))
    assert len(valid) == 8 and set(valid.dataset_index[:8].tolist()) == {0, 1}
    assert [d.dataset_path for d in train.datasets] == [token_data, second_token_data]


def test_blend_resumes_as_the_same_data(token_data, second_token_data):
    from megatron_ext.resume import resume_position

    recipe = _recipe([token_data, second_token_data], "cpt", "data.weights=[3, 1]")
    saved = {"consumed_samples": 8, "tokens": 2048, "recipe": recipe.to_dict()}  # lists, as the metadata JSON has
    assert resume_position(saved, 4, recipe)[2] == []
    other = _recipe([token_data, second_token_data], "cpt", "data.weights=[1, 1]")
    assert resume_position(saved, 4, other)[2] == ["data.weights: [3.0, 1.0] -> [1.0, 1.0]"]


def test_a_blend_that_lost_a_dataset_is_changed_data(token_data, second_token_data):
    """The saved run blended three datasets, this one the first two of them (same weights for those): another
    sample order, named as a data.prefix change, not taken for the same data because the common datasets match."""
    import copy

    from megatron_ext.resume import resume_position

    recipe = _recipe([token_data, second_token_data], "cpt", "data.weights=[3, 1]")
    old = copy.deepcopy(recipe.to_dict())
    old["data"]["prefix"] = [token_data, second_token_data, "/gone/third"]
    old["data"]["weights"] = [3.0, 1.0]
    saved = {"consumed_samples": 8, "tokens": 2048, "recipe": old}
    assert resume_position(saved, 4, recipe)[2] == [
        f"data.prefix: {[token_data, second_token_data, '/gone/third']!r} -> {[token_data, second_token_data]!r}"]
