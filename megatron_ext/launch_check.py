"""Pre-launch validation of a training job (`python -m megatron_ext.launch --check`, which slurm/common.sh runs
before srun, and the stage checks of a submission): the recipe and overrides for the job's task count, its data and
checkpoint paths, GPUs per node, and what the run will do with the checkpoint already in its `checkpoint.dir`.
Runs on a login node: neither torch nor Megatron-Core is imported for it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from megatron_ext.recipe import Recipe, RecipeError, load_recipe
from megatron_ext import slurm_jobs
from megatron_ext.slurm_jobs import EXIT_ASK_HOST, OWNER_UNKNOWN_LINE, OwnerStateUnknown, claim_checkpoint_dir
from megatron_ext.train_setup import check_metrics_file, check_setup, setup_warnings


def check(recipe_path: str, overrides: list[str], world_size: int | None, tasks_per_node: int | None = None,
          gpus_per_node: int | None = None, paths: bool = True) -> Recipe:
    """Load and validate a recipe for a job of `world_size` tasks (None: its cluster block's size).

    Raises `RecipeError` with one line.
    `paths`: also require the data files and `checkpoint.init_from` (false for a stage whose input
    an earlier stage of the same chain writes). `gpus_per_node`: GPUs Slurm gave each node; a cuda
    recipe needs one per task, and `tasks_per_node` a multiple of its tensor-parallel size (TP within a node).
    """
    if not Path(recipe_path).is_file():
        raise RecipeError(f"recipe {recipe_path!r}: file not found; give a recipe YAML, e.g. recipes/cpt_1m.yaml")
    # Looked for, not imported (~8 s): the check itself needs neither, the trainer both.
    missing = [m for m in ("torch", "megatron.core") if not _findable(m)]
    if missing:
        raise RecipeError(f"python {sys.executable} cannot import {' and '.join(missing)}, which the trainer needs; "
                          "use the python of the environment megatron_ext is installed in (sbatch: export "
                          "PYTHON=/path/to/venv/bin/python)")
    recipe = load_recipe(recipe_path, overrides, world_size=world_size)
    if paths:
        check_setup(recipe)
        check_metrics_file(recipe.checkpoint.dir)  # read through here once, not by every rank (check_setup)
        check_data_caches(recipe)
    if tasks_per_node is not None:
        check_tensor_parallel_within_node(recipe, tasks_per_node)
    if recipe.runtime.device == "cuda" and gpus_per_node is not None and tasks_per_node is not None:
        if gpus_per_node < tasks_per_node:
            raise RecipeError(
                f"runtime.device = 'cuda': {tasks_per_node} tasks per node but {gpus_per_node} GPUs per node "
                f"allocated; submit with --gpus-per-node={tasks_per_node} (one task per GPU) or set runtime.device=cpu")
    return recipe


def _findable(module: str) -> bool:
    """`module` can be imported by this python (looked for, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # find_spec("megatron.core") raises, not None, where `megatron` itself is missing
        return False


def check_data_caches(recipe: Recipe) -> None:
    """RecipeError naming a file of the CPT index-cache folder that is not a plain .npy array: the trainer refuses it
    after its ranks have started (`check_index_caches`, by rank 0), a job here before it queues its workers. Not in
    `check_setup`, which every rank of the trainer runs (512 ranks reading every cache file's header)."""
    from megatron_ext.data import DataError
    from megatron_ext.data.dataset_files import check_index_caches, index_cache_folder

    d = recipe.data
    if recipe.train.stage != "cpt" or not d.prefixes:
        return
    try:
        check_index_caches([index_cache_folder(d.prefixes, d.cache_dir)])
    except DataError as e:
        where = "data.cache_dir" if d.cache_dir else "data.cache_dir (null: cache/ beside data.prefix)"
        raise RecipeError(f"{where}: {e}") from None


def check_tensor_parallel_within_node(recipe: Recipe, tasks_per_node: int, where: str = "") -> None:
    """RecipeError when a cuda run's tensor-parallel groups would span nodes of `tasks_per_node` tasks each."""
    if recipe.runtime.device == "cuda" and tasks_per_node % recipe.parallel.tensor:
        # Megatron puts TP on consecutive ranks: with whole groups per node they stay on NVLink
        raise RecipeError(f"{where}parallel.tensor = {recipe.parallel.tensor} with {tasks_per_node} tasks per node: "
                          "tensor parallel groups would span nodes (their all-reduce over the network in every layer); "
                          "give a number of tasks per node that parallel.tensor divides, or a smaller parallel.tensor")


def describe(recipe: Recipe, world_size: int) -> str:
    """One line: name, stage, layout and length, e.g. `cpt_4m: cpt TP8 PP1 CP16 DP2 on 256 ...`."""
    p, t = recipe.parallel, recipe.train
    dp = world_size // (p.tensor * p.pipeline * p.context)
    return (f"{recipe.name}: {t.stage} TP{p.tensor} PP{p.pipeline} CP{p.context} DP{dp} on {world_size} "
            f"processes ({recipe.runtime.device}), seq {t.seq_length}, {t.steps} steps, "
            f"checkpoint.dir {recipe.checkpoint.dir}")


def resume_report(recipe: Recipe, world_size: int) -> list[str]:
    """What the run will do with the checkpoint already in its `checkpoint.dir` (nothing there: []).

    Raises RecipeError where the trainer would stop on it (incomplete checkpoint, another model), so a
    job learns it before its workers start.
    """
    from megatron_ext.checkpoint_cli import verdict
    from megatron_ext.checkpoint_index import CheckpointError, check_complete
    from megatron_ext.checkpoint_layout import latest_iteration, read_metadata, resolve_iteration_dir
    from megatron_ext.resume import plan_resume

    root = Path(recipe.checkpoint.dir)
    p = recipe.parallel
    try:
        done = latest_iteration(root) if root.is_dir() else None
        if done is None:
            return []
        check_complete(resolve_iteration_dir(root, done)[1])
        r = plan_resume(read_metadata(root), done, recipe, world_size // (p.tensor * p.pipeline * p.context))
    except CheckpointError as e:
        raise RecipeError(f"checkpoint.dir = {str(root)!r}: {e}") from None
    if r.stage_refusal:
        raise RecipeError(r.stage_refusal)
    if r.architecture_changed:
        raise RecipeError(f"checkpoint.dir = {str(root)!r} holds another model ({'; '.join(r.architecture_changed)}); "
                          "use that model's recipe, or a new checkpoint.dir with checkpoint.init_from")
    return [line.strip() for line in verdict(r, recipe.train.steps)]


def run_check(args) -> int:
    """`--check`: validate the recipe for the job, say what it does with its checkpoint, and with `--claim` record
    this Slurm job as the writer of checkpoint.dir (refused while another live job holds it).

    The preflight of a container job (slurm/common.sh) adds `--host-squeue`: where squeue cannot be asked here about
    the job that holds checkpoint.dir, the last line says `claim-owner-unknown: ID` and the exit is EXIT_ASK_HOST (5);
    the batch shell asks squeue and checks again with `--owner-state ID=STATE`, taken for job ID's state (only)."""
    given = dict(getattr(args, "owner_state", None) or [])
    host_squeue = getattr(args, "host_squeue", False)
    if (given or host_squeue) and not args.claim:
        raise RecipeError("--owner-state and --host-squeue go with --claim (slurm/common.sh's preflight passes them)")
    recipe = check(args.recipe, args.overrides, args.world_size, args.tasks_per_node, args.gpus_per_node, paths=True)
    world = args.world_size if args.world_size is not None else recipe.cluster.nodes * recipe.cluster.gpus_per_node
    report = resume_report(recipe, world)  # before "ok": a checkpoint the run cannot resume is an error
    print(f"ok: {describe(recipe, world)}", flush=True)
    for warning in setup_warnings(recipe):
        print(f"warning: {warning}", flush=True)
    for line in report:
        print(f"checkpoint: {line}", flush=True)
    if args.claim:  # last: a job that fails a check above leaves no folder behind
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            raise RecipeError("--claim: no SLURM_JOB_ID; it records the Slurm job that writes checkpoint.dir")
        def state_of(owner: str) -> str | None:  # what the batch host's squeue said of that job, else squeue here
            return (given[owner] or None) if owner in given else slurm_jobs.job_state(owner)

        try:
            claim_checkpoint_dir(recipe.checkpoint.dir, job, state_of=state_of)
        except OwnerStateUnknown as e:
            if not host_squeue or e.owner in given or not e.owner.isdigit():
                raise
            print(f"{OWNER_UNKNOWN_LINE} {e.owner}", flush=True)
            return EXIT_ASK_HOST
    return 0
