"""Partial full recompute (`train.recompute_layers`, Megatron's block method): same numbers as no recompute,
memory between none and full, as the planner predicts it."""

import pytest
import torch

from megatron_ext import cost_model as C
from megatron_ext import plan as P
from megatron_ext.model import build_model_from_recipe
from megatron_ext.recipe import RecipeError, load_recipe
from tests.unit.test_plan_memory import TOLERANCE, _measure

LAYERS = 4


def _recipe(recompute="none", layers=None, seq=1024):
    return load_recipe("recipes/tiny/base.yaml", [
        f"train.seq_length={seq}", f"train.recompute={recompute}", f"train.recompute_layers={layers or 'null'}",
        f"model.num_hidden_layers={LAYERS}", "cluster.gpus_per_node=1", "train.global_batch_size=1",
        "train.loss_head=chunked", "train.loss_chunk_tokens=256"])


def _loss_and_grads(recipe):
    torch.manual_seed(0)
    model = build_model_from_recipe(recipe)
    L = recipe.train.seq_length
    tokens = torch.randint(0, recipe.model.vocab_size, (1, L), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, torch.arange(L)[None], None, labels=tokens).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_partial_recompute_gives_the_same_loss_and_gradients(cpu_parallel_state):
    loss, grads = _loss_and_grads(_recipe("none", seq=256))
    for layers in (1, 3, None):
        got_loss, got_grads = _loss_and_grads(_recipe("full", layers, seq=256))
        assert got_loss == loss
        assert all(torch.equal(a, b) for a, b in zip(got_grads, grads)), layers


def test_partial_recompute_memory_is_between_and_as_planned(cpu_parallel_state):
    saved = {}
    for name, recompute, layers in (("none", "none", None), ("block2", "full", 2), ("full", "full", None)):
        recipe = _recipe(recompute, layers)
        _, saved[name], _ = _measure(recipe)
        if name == "block2":
            planned = P.plan(recipe, C.GPUS["h100-80gb"], 1).memory.activations
            # two layers keep their inputs, two all their tensors: the planner's block formula
            assert abs(planned / saved[name] - 1) < TOLERANCE, (planned, saved[name])
            per_layer = C.activation_bytes_per_token_layer(C.Shape.from_recipe(recipe), 1, True, 4.0, "local")
            assert planned == pytest.approx(1024 * (2 * 4.0 * recipe.model.hidden_size + 2 * per_layer))
    assert saved["full"] < saved["block2"] < saved["none"]
    # the two recomputed layers keep only their inputs: about half of no recompute's tensors are gone
    assert 0.35 < saved["block2"] / saved["none"] < 0.65, saved


def test_recompute_layers_rules():
    with pytest.raises(RecipeError, match="train.recompute_layers = 2: needs train.recompute = 'full'"):
        _recipe("none", 2)
    with pytest.raises(RecipeError, match=r"train.recompute_layers = 5: must be between 1 and the layers of a "
                                          r"pipeline stage \(4 = "):
        _recipe("full", 5)
