"""Pins of `megatron_ext.launch_check` (the pre-submit `launch --check`) found by mutation audit round 8: the one-line
errors a user gets before a job queues, and the layout line it prints."""

from __future__ import annotations

import argparse
import os
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


def test_a_claim_held_by_a_non_numeric_owner_is_refused_not_handed_to_the_host(tmp_path: Path, token_data: Path,
                                                                                monkeypatch, capsys) -> None:
    """A `.slurm_job` naming no numeric job (hand-edited) whose state squeue cannot give: the preflight with
    `--host-squeue` stops with the one error line (the batch host's squeue could not answer for it either), not
    `claim-owner-unknown` and exit 5; a numeric owner is handed over (the control). (LC26: the non-numeric owner was
    handed to the host.) squeue is stood in for: it cannot be asked here."""
    from megatron_ext import launch, slurm_jobs
    from megatron_ext.slurm_jobs import OWNER_FILE
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # the recipe path is relative to the repository
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(slurm_jobs, "job_state", lambda job: "UNKNOWN (squeue: No such file or directory)")
    args = ["--check", "--claim", "--host-squeue", "--recipe", RECIPE, "--world-size", "2", f"data.prefix={token_data}",
            f"checkpoint.dir={run}"]
    (run / OWNER_FILE).write_text("41\n")
    assert launch.main(args) == 5
    assert capsys.readouterr().out.splitlines()[-1] == "claim-owner-unknown: 41"
    (run / OWNER_FILE).write_text("mine\n")
    assert launch.main(args) == 1
    captured = capsys.readouterr()
    assert "claim-owner-unknown" not in captured.out
    assert "is held by Slurm job mine" in captured.err and captured.err.count("\n") == 1


def test_the_preflight_refuses_a_cuda_job_given_fewer_gpus_than_tasks(tmp_path: Path, token_data: Path, monkeypatch,
                                                                       capsys) -> None:
    """`launch --check --tasks-per-node 2 --gpus-per-node 1` of a cuda recipe (what slurm/common.sh passes from
    Slurm's allocation): the one line naming `--gpus-per-node=2`, before the workers queue; 2 GPUs pass (the control).
    (LC28: run_check dropped the GPU count, and the job failed on its nodes instead.)"""
    from megatron_ext import launch
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    args = ["--check", "--recipe", RECIPE, "--world-size", "2", "--tasks-per-node", "2", f"data.prefix={token_data}",
            f"checkpoint.dir={tmp_path / 'run'}", "runtime.device=cuda"]
    assert launch.main([*args, "--gpus-per-node", "1"]) == 1
    assert "2 tasks per node but 1 GPUs per node allocated; submit with --gpus-per-node=2" in capsys.readouterr().err
    assert launch.main([*args, "--gpus-per-node", "2"]) == 0, capsys.readouterr().err


def test_an_sft_run_is_not_refused_for_a_cpt_cache_file_it_never_reads(tmp_path: Path, sft_data: Path,
                                                                         monkeypatch, capsys) -> None:
    """data.cache_dir holds the CPT sample-index caches; an SFT run reads none, so a junk file there does not stop its
    preflight (LC11: the cache check ran for every stage and refused the SFT job)."""
    from megatron_ext import launch
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "0123456789abcdef0123456789abcdef-GPTDataset-train-shuffle_index.npy").write_bytes(b"not an array")
    args = ["--check", "--recipe", "recipes/tiny/sft.yaml", "--world-size", "1", f"data.prefix={sft_data}",
            f"data.cache_dir={cache}", f"checkpoint.dir={tmp_path / 'run'}", "checkpoint.init_from=null"]
    assert launch.main(args) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok: ")


def test_an_unreadable_checkpoint_is_named_as_the_checkpoint_dir(tmp_path: Path) -> None:
    """A checkpoint.dir whose latest iteration has no torch_dist index (a save cut short): the error starts with
    `checkpoint.dir = '<dir>':`, the recipe field to change, before the file it could not read (LC30: only the
    file's message, which names no recipe field)."""
    from megatron_ext.launch_check import resume_report

    root = tmp_path / "ckpt"
    (root / "iter_0000004").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("4\n")
    recipe = check(RECIPE, TINY + ["runtime.device=cpu", f"checkpoint.dir={root}"], world_size=2, paths=False)
    with pytest.raises(RecipeError) as e:
        resume_report(recipe, 2)
    assert str(e.value).startswith(f"checkpoint.dir = '{root}': {root}/iter_0000004/.metadata: not a readable")
    assert resume_report(check(RECIPE, TINY + ["runtime.device=cpu", f"checkpoint.dir={tmp_path / 'new'}"],
                               world_size=2, paths=False), 2) == []  # nothing there yet: nothing to report


def test_a_python_without_megatron_core_is_named(tmp_path: Path) -> None:
    """A python where `megatron` is not the Megatron-Core package (here a stray megatron.py shadows it, as a missing
    package would leave find_spec("megatron.core") raising): the one line naming megatron.core, no traceback
    (LC10: ModuleNotFoundError no longer caught; LC2: looking for `megatron` found the stray module and passed)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "megatron.py").write_text("")
    code = ("from megatron_ext.launch_check import check\nfrom megatron_ext.recipe import RecipeError\n"
            "try:\n    check('recipes/tiny/cpt.yaml', [], world_size=2, paths=False)\n    print('ok')\n"
            "except RecipeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert done.stdout.startswith(f"python {sys.executable} cannot import megatron.core, which the trainer needs; "
                                  "use the python of the environment"), done.stdout + done.stderr


def test_a_python_without_both_names_both(monkeypatch) -> None:
    """Neither torch nor megatron.core importable (a login node's system python): one line naming both, so one fix
    serves (LC3: only the first was named). find_spec stands in for the python: this one has both."""
    import importlib.util
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "megatron.core") else find_spec(name, *a))
    with pytest.raises(RecipeError) as e:
        check(RECIPE, [], world_size=2, paths=False)
    assert str(e.value).startswith(f"python {sys.executable} cannot import torch and megatron.core, which the trainer")
