"""A resumed CPT run reads the sample order its checkpoint's run was built with: Megatron-Core's GPTDataset
orders samples by the number of epochs a request needs, so the request is kept (checkpoint `data_samples`), and a
run that needs more than that is warned about (megatron_ext.resume)."""

from megatron_ext.recipe import load_recipe
from megatron_ext.resume import data_request, plan_resume, train_split_epochs
from megatron_ext.training_data import build_batches
from tests.conftest import ROOT


def _recipe(data, *overrides):
    return load_recipe(ROOT / "recipes/tiny/cpt.yaml", [f"data.prefix={data}", "checkpoint.dir=/tmp/unused",
                                                        "parallel.context=1", "train.seq_length=512",
                                                        "train.global_batch_size=2", *overrides], world_size=1)


def _tokens(batches, ids):
    return [batches.dataset[i]["tokens"].tolist() for i in ids]


def test_resume_with_fewer_steps_reads_the_saved_order(token_data):
    """120 samples of 512 tokens take two epochs of the 120 test documents, 60 one: two orders."""
    original, _ = build_batches(_recipe(token_data, "train.steps=60"), 0, 1, 0, 1)
    assert original.requested == 120
    shorter = _recipe(token_data, "train.steps=30")
    kept, _ = build_batches(shorter, 0, 1, 0, 1, first_step=3, consumed_samples=6, min_train_samples=120)
    assert kept.requested == 120 and _tokens(kept, range(6, 60)) == _tokens(original, range(6, 60))
    # control: asked for what the shorter run reads, GPTDataset orders the samples another way
    fresh, _ = build_batches(shorter, 0, 1, 0, 1, first_step=3, consumed_samples=6)
    assert fresh.requested == 60 and _tokens(fresh, range(6, 60)) != _tokens(original, range(6, 60))


def test_more_samples_than_the_saved_order_is_warned_about(token_data):
    three = _recipe(token_data, "train.steps=3")
    saved = {"consumed_samples": 6, "tokens": 3072, "recipe": three.to_dict(), "data_samples": 6}
    r = plan_resume(saved, 3, _recipe(token_data, "train.steps=60"), 1)
    assert r.data_samples == 6 and ("this run reads 120 samples, its checkpoint's data order was built for 6 "
                                    "(2 epochs of the data instead of 1)") in r.order_warning
    # more samples within the first epoch (GPTDataset's order is the same): no warning
    assert plan_resume(saved, 3, _recipe(token_data, "train.steps=30"), 1).order_warning is None
    assert train_split_epochs(three, 60) == 1 and train_split_epochs(three, 120) == 2
    assert plan_resume({**saved, "data_samples": 120}, 3, _recipe(token_data, "train.steps=60"), 1).order_warning \
        is None
    # a smaller global batch reads no further than the saved order: no warning
    assert plan_resume({**saved, "data_samples": 120}, 3, _recipe(token_data, "train.steps=60",
                                                                  "train.global_batch_size=1"), 1).order_warning is None
    # checkpoints from before the field: a run asked for steps x global batch
    old = {k: v for k, v in saved.items() if k != "data_samples"}
    assert data_request(old) == 6 and plan_resume(old, 3, _recipe(token_data, "train.steps=60"), 1).order_warning


def test_epoch_count_is_gptdatasets(token_data):
    """train_split_epochs counts as GPTDataset does: its own epoch count for the request (control: one sample
    more than one epoch holds needs two)."""
    recipe = _recipe(token_data, "train.steps=60")
    batches, _ = build_batches(recipe, 0, 1, 0, 1)
    dataset = batches.dataset
    per_epoch = dataset._get_num_tokens_per_epoch()
    assert dataset._get_num_epochs(per_epoch) == train_split_epochs(recipe, 120) == 2
    fits = (per_epoch - 1) // 512  # the most samples one epoch serves
    assert train_split_epochs(recipe, fits) == 1 and train_split_epochs(recipe, fits + 1) == 2


def test_epoch_count_when_the_samples_end_on_an_epochs_last_token(token_data):
    """GPTDataset counts one token more than the samples' tokens (the last label): a request whose tokens are a
    whole number of epochs exactly needs one epoch more. Oracle: GPTDataset's own _get_num_epochs for that request."""
    import copy
    import math

    recipe = _recipe(token_data, "train.steps=60")
    dataset = build_batches(recipe, 0, 1, 0, 1)[0].dataset
    per_epoch = dataset._get_num_tokens_per_epoch()
    exact = per_epoch // math.gcd(per_epoch, 512)  # the fewest samples whose 512-token sequences fill whole epochs

    def gptdataset_epochs(samples: int) -> int:
        asked = copy.copy(dataset)
        asked.num_samples = samples
        return asked._get_num_epochs(per_epoch)

    for samples in (exact - 1, exact, exact + 1, 2 * exact):
        assert train_split_epochs(recipe, samples) == gptdataset_epochs(samples), samples
    assert gptdataset_epochs(exact) == exact * 512 // per_epoch + 1  # the case that needs the extra token
