"""Pins of `megatron_ext.launch_check` (the pre-submit `launch --check`) found by mutation audit round 8: the one-line
errors a user gets before a job queues, and the layout line it prints."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron_ext.launch_check import check, check_tensor_parallel_within_node, describe, run_check
from megatron_ext.recipe import RecipeError

RECIPE = "recipes/tiny/cpt.yaml"
TINY = ["train.seq_length=256", "train.global_batch_size=12", "model.max_position_embeddings=256"]


def test_a_folder_given_as_recipe_is_refused_as_not_a_file(tmp_path: Path) -> None:
    """`--recipe recipes/tiny` style folder where a YAML file is needed: the one 'file not found' line naming it
    (LC1: testing existence instead let the folder through to the YAML loader)."""
    with pytest.raises(RecipeError, match=r"recipe '.*': file not found; give a recipe YAML"):
        check(str(tmp_path), [], world_size=2, paths=False)


def test_the_world_size_reaches_the_recipe_check() -> None:
    """A job of 3 tasks cannot hold the tiny recipe's CP=2: refused before the job queues (LC4: the task count was
    dropped, and the recipe's own cluster size used instead)."""
    with pytest.raises(RecipeError, match=r"= 2 does not divide the world size = 3; change parallel"):
        check(RECIPE, TINY + ["runtime.device=cpu"], world_size=3, paths=False)
    assert check(RECIPE, TINY + ["runtime.device=cpu"], world_size=2, paths=False).parallel.context == 2


def test_a_cuda_job_with_fewer_gpus_than_tasks_is_refused_with_the_fix() -> None:
    """cuda run, 4 tasks per node on 3 GPUs: one line naming both counts and `--gpus-per-node=4`; 4 GPUs pass
    (LC7: check dropped, LC8: off by one, LC9: the fix named the allocated count)."""
    cuda = TINY + ["runtime.device=cuda"]
    with pytest.raises(RecipeError) as e:
        check(RECIPE, cuda, world_size=4, tasks_per_node=4, gpus_per_node=3, paths=False)
    assert str(e.value) == ("runtime.device = 'cuda': 4 tasks per node but 3 GPUs per node allocated; submit with "
                            "--gpus-per-node=4 (one task per GPU) or set runtime.device=cpu")
    with pytest.raises(RecipeError, match="4 tasks per node but 2 GPUs"):
        check(RECIPE, cuda, world_size=4, tasks_per_node=4, gpus_per_node=2, paths=False)
    check(RECIPE, cuda, world_size=4, tasks_per_node=4, gpus_per_node=4, paths=False)


def test_tensor_parallel_across_nodes_matters_only_on_cuda() -> None:
    """TP=2 over 3 tasks per node: refused for cuda (groups would span nodes), accepted for a cpu/gloo run, which has
    no NVLink to keep them on (LC13: the cpu run refused too)."""
    over = TINY + ["parallel.tensor=2", "parallel.context=1"]
    cpu = check(RECIPE, over + ["runtime.device=cpu"], world_size=6, paths=False)
    check_tensor_parallel_within_node(cpu, 3)
    cuda = check(RECIPE, over + ["runtime.device=cuda"], world_size=6, paths=False)
    with pytest.raises(RecipeError, match=r"^parallel.tensor = 2 with 3 tasks per node: tensor parallel groups"):
        check_tensor_parallel_within_node(cuda, 3)


def test_the_layout_line_counts_context_parallel_out_of_data_parallel() -> None:
    """`ok:` line of CP=2 on 4 processes says DP2, not DP4 (LC15: CP left out of the divisor)."""
    recipe = check(RECIPE, TINY + ["runtime.device=cpu"], world_size=4, paths=False)
    assert " TP1 PP1 CP2 DP2 on 4 processes (cpu)" in describe(recipe, 4)


def test_host_squeue_without_claim_is_refused() -> None:
    """`--host-squeue` alone (no `--claim`) is a misuse named in one line, before any recipe is read (LC21: only
    `--owner-state` was refused)."""
    args = argparse.Namespace(owner_state=None, host_squeue=True, claim=False, recipe="no/such.yaml", overrides=[],
                              world_size=2, tasks_per_node=None, gpus_per_node=None)
    with pytest.raises(RecipeError, match=r"^--owner-state and --host-squeue go with --claim"):
        run_check(args)
