"""Pins of `megatron_ext.recipe_rules` found by a hand mutation audit (round 6): cross-field rules whose edge (the
equal case, the per-stage count, the right factor) the broader recipe tests left open. Each refused recipe would
otherwise fail later and less clearly (a ZeroDivisionError at dp = 0, a pipeline stage asked to recompute layers it
does not hold, a launcher hint with the wrong process count)."""

import pytest

from megatron_ext.recipe import RecipeError, load_recipe
from megatron_ext.recipe_rules import WorldSizeError

BASE = {
    "model": {"preset": "tiny"},  # 2 layers, 4 heads, 2 KV heads
    "train": {"seq_length": 256, "steps": 3, "lr": 3e-5, "global_batch_size": 4},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "runtime": {"device": "cpu"},
}


def refused(overrides, fragment, world_size=2):
    with pytest.raises(RecipeError) as e:
        load_recipe(raw=BASE, overrides=overrides, world_size=world_size)
    assert fragment in str(e.value), str(e.value)
    return e.value


@pytest.mark.parametrize("overrides, world, fragment", [
    # a world of 0 processes left data parallel 0 and the batch rule divided by it
    ([], 0, "world size = 0: a run has at least 1 process"),
    # warm-up as long as the run never reaches train.lr
    (["train.warmup_steps=3"], 2, "train.warmup_steps = 3: must be below train.steps = 3"),
    # each of the 2 pipeline stages holds 1 of the 2 layers: it cannot recompute 2
    (["parallel.pipeline=2", "train.recompute=full", "train.recompute_layers=2"], 2,
     "train.recompute_layers = 2: must be between 1 and the layers of a pipeline stage (1 = "),
    (["model.num_key_value_heads=3"], 1, "model.num_key_value_heads = 3: must divide model.num_attention_heads = 4"),
    (["parallel.context=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_context_sizes=[2, 1]"], 4,
     "needs [a2a size, p2p size] with product parallel.context = 4"),
    # a step takes micro_batch_size x dp sequences, not dp
    (["train.micro_batch_size=2", "train.global_batch_size=6"], 2,
     "train.global_batch_size = 6: must be divisible by micro_batch_size x data parallel = 2 x 2 = 4"),
    # CUDA-only rules, checked at load on any machine
    (["runtime.device=cuda", "runtime.attention=te", "train.precision=fp32", "parallel.context=2"], 2,
     "runtime.attention = 'te' with train.precision = 'fp32' and parallel.context = 2"),
    (["runtime.device=cuda", "runtime.fp8=hybrid", "runtime.fp8_attention=true", "parallel.context=4",
      "parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_context_sizes=[2, 2]"], 4,
     "runtime.fp8_attention with parallel.cp_comm_type = 'a2a+p2p': TE supports FP8 attention under CP only"),
    # H200 is sm90 like H100: no current-scaling FP8 attention
    (["runtime.device=cuda", "cluster.gpu=h200-141gb", "runtime.fp8=hybrid", "runtime.fp8_attention=true",
      "runtime.fp8_recipe=tensorwise"], 2, "runtime.fp8_recipe = 'tensorwise' on cluster.gpu = 'h200-141gb'"),
    # only flash takes the CP chunks' lower-right causal bias without a dense mask
    (["runtime.device=cuda", "runtime.attention=sdpa", "runtime.sdpa_kernel=efficient", "parallel.context=2"], 2,
     "runtime.sdpa_kernel = 'efficient' with parallel.context = 2"),
    # sequence parallelism splits each CP rank's 260 / 2 = 130 tokens over TP 4 (260 itself divides by 4)
    (["runtime.device=cuda", "model.num_key_value_heads=4", "parallel.tensor=4", "parallel.context=2",
      "parallel.sequence_parallel=true", "train.seq_length=260", "train.global_batch_size=1"], 8,
     "train.seq_length = 260: with parallel.sequence_parallel each rank's 130 tokens"),
])
def test_rule_edges(overrides, world, fragment):
    refused(overrides, fragment, world)


def test_world_size_error_names_the_fewest_processes_of_the_layout():
    """TP 2 x CP 2 needs a multiple of 4 processes: the launcher hint says 4, not the world size it got."""
    e = refused(["parallel.tensor=2", "parallel.context=2"], "= 4 does not divide the world size = 6", world_size=6)
    assert isinstance(e, WorldSizeError) and e.fewest == 4
    assert "torchrun --nproc_per_node=4" in e.started_alone()


def test_profile_ranks_are_bounded_by_the_launched_world_only():
    """cluster.* is not the world a launcher gives (a recipe loaded for planning, or run under a larger torchrun):
    without a world size profile.ranks is not checked against nodes x gpus_per_node, with one it is."""
    recipe = load_recipe(raw=BASE, overrides=["profile.steps=[2,3]", "profile.ranks=[0,3]"])
    assert recipe.profile.ranks == (0, 3)
    refused(["profile.steps=[2,3]", "profile.ranks=[0,3]"], "profile.ranks = [0, 3]: the run has ranks 0..1")
