"""A step's loss (megatron_ext.train_step): each microbatch reports the *sum* of its unmasked tokens' losses and
their count, and the step's loss is the global token mean of those, against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.train_step import loss_func, reduce_loss


def test_loss_func_sums_the_unmasked_tokens_and_counts_them():
    """The loss is a sum, not a mean (finalize_model_grads divides by the global count): masked tokens (SFT prompts,
    padding) add nothing and are not counted; the report carries the packed attention's pairs for the FLOP count."""
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.bfloat16, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    loss_sum, count, report = loss_func(mask, 21, losses)
    assert loss_sum.dtype == torch.float32 and loss_sum.item() == 1 + 3 + 5 + 6
    assert count.item() == 4 and not count.is_floating_point()
    assert report["lm loss"].tolist() == [15.0, 4.0, 21.0] and report["lm loss"].dtype == torch.float64
    # the report is kept for the whole step: detached, it holds no microbatch's autograd graph
    assert not report["lm loss"].requires_grad and report["lm loss"].grad_fn is None
    loss_sum.backward()
    assert losses.grad.tolist() == mask.float().tolist()  # a masked token gets no gradient


def test_reduce_loss_is_the_token_mean_over_the_microbatches(cpu_parallel_state):
    """Two microbatches, 3 and 1 counted tokens: the step's loss is (9 + 7) / 4 = 4, not the mean of the
    microbatches' means (3 and 7: 5); the tokens and the attention pairs add up. No counted token gives 0, not NaN."""
    reports = [{"lm loss": torch.tensor([9.0, 3.0, 10.0], dtype=torch.float64)},
               {"lm loss": torch.tensor([7.0, 1.0, 5.0], dtype=torch.float64)}]
    assert reduce_loss(reports) == (pytest.approx(4.0), 4, 15)
    assert reduce_loss([{"lm loss": torch.zeros(3, dtype=torch.float64)}]) == (0.0, 0, 0)


def test_validation_loss_is_the_token_mean_over_eval_iters_global_batches(cpu_parallel_state):
    """validation_loss through Megatron-Core's real schedule on the tiny model: the token mean over the first
    train.eval_iters global batches of the valid samples (each read once, masked tokens left out), computed here
    sample by sample with the model's own per-token losses; the model is left in training mode."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.recipe import load_recipe
    from megatron_ext.train_step import validation_loss
    from megatron_ext.training_data import TrainBatches
    from tests.conftest import ROOT
    from tests.unit.test_checkpoint import setup

    model = setup(0, False)[0]
    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", [
        "checkpoint.dir=/tmp/unused", "parallel.context=1", "train.seq_length=32", "train.global_batch_size=2",
        "train.eval_iters=2"], world_size=1)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):  # 2 more than validation reads
        tokens = torch.randint(0, 512, (33,), generator=g)
        mask = torch.ones(32, dtype=torch.float32)
        mask[: 4 * i] = 0  # another number of counted tokens in each sample
        samples.append({"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": mask,
                        "position_ids": torch.arange(32)})
    batches = TrainBatches(recipe, 0, 1, 0, 1, dataset=samples, new_order_each_pass=False)
    loss, tokens = validation_loss(get_forward_backward_func(), model, batches, recipe, num_microbatches=2)
    assert model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples[:4]:
            per_token = model(s["tokens"][None], s["position_ids"][None], None, labels=s["labels"][None])[0]
            total += (per_token.double() * s["loss_mask"]).sum().item()
            count += int(s["loss_mask"].sum())
    assert tokens == count == 32 * 4 - 4 * (0 + 1 + 2 + 3)
    assert loss == pytest.approx(total / count, rel=1e-5)
