"""Submit training stages to Slurm from Python (a login node) through submitit.

    python -m megatron_ext.launch --recipe recipes/cpt_1m.yaml --stages cpt_1m,sft \
        [--nodes N --gpus-per-node G --partition P --account A --time T] [--niah LENGTHS] [--ruler LENGTHS] \
        [--dry-run] [--wait] \
        [dotted.key=value ...] [STAGE:dotted.key=value ...]

Each stage is one recipe, run as one Slurm job of `nodes x gpus_per_node` tasks (one per GPU);
stage k+1 waits for stage k with `--dependency=afterok`. `--stages` names recipes in the folder of
`--recipe` (`sft` -> that folder's `sft.yaml`; a name ending in `.yaml` is a path); without it the
one `--recipe` runs. Overrides apply to every stage; `STAGE:key=value` only to the stage named STAGE.
An SFT stage starts from the `checkpoint.dir` of the stage before it unless `STAGE:checkpoint.init_from` is given.
Nodes and GPUs per node default to the recipe's `cluster` block (the recipe is the source of truth).
`--niah 128K:1M:4` adds one more job after the last stage: NIAH of its checkpoint on the Megatron engine
(`tools/niah.py --engine megatron`, what slurm/pipeline.sh --niah runs) at the TP x CP of the stage with the
longest sequences, chat prompts after an SFT stage, results in `<checkpoint.dir>_niah/`; `--ruler LENGTHS` one
more for the RULER-style tasks (`launch_eval.py`), also after the last stage (a failed NIAH does not cancel it).

Preemption and time limits: the jobs are sent USR1 `signal_delay_s` before the limit (and on
`scancel --signal=USR1`); the trainer saves a checkpoint and returns `EXIT_REQUEUE`, and rank 0 then
requeues the job (`scontrol requeue`), which resumes from the checkpoint.

`--check` is the pre-launch validation the sbatch scripts (slurm/common.sh) run before srun
(`megatron_ext.launch_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_ext.cli_types import whole_number
from megatron_ext.evaluate.errors import EvalError
from megatron_ext.launch_eval import eval_jobs
from megatron_ext.launch_stages import Stage, chain_sft_stage, check_stage_follows, check_stage_order, plan_stages
from megatron_ext.recipe import Recipe, RecipeError, load_recipe
from megatron_ext.launch_check import check, check_tensor_parallel_within_node, describe, run_check
from megatron_ext.launch_submit import SubmissionError, Submitted, after, check_submit_folder
from megatron_ext.slurm_jobs import (check_warning_fits, claim_checkpoint_dir, parse_owner_state,
                                     requeue_ends_the_task, requeue_refusal)
from megatron_ext.train_setup import check_data, check_metrics_file, check_setup

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# The trainer's SIGUSR1 handler saves and exits with EXIT_REQUEUE; submitit reads this variable
# (at import, in the submitter and in every task) to choose the signal it asks Slurm to send.
PREEMPT_SIGNAL = "USR1"
DEFAULT_TIME = "04:00:00"
DEFAULT_SIGNAL_DELAY_S = 600  # USR1 this long before the time limit where a stage has no sbatch script
GPU_CPUS_PER_TASK = 8  # as slurm/*.sh: data loading and the Python side of each rank


def parse_time(text: str) -> int:
    """Slurm time (`MM`, `HH:MM:SS`, `D-HH:MM:SS`, `D-HH`) -> minutes, rounded up."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise RecipeError(f"--time {text!r}: use minutes or [D-]HH:MM:SS, e.g. 04:00:00")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is None and b is None:
        return a  # plain minutes
    if days is not None and b is None:
        hours, minutes, seconds = a, 0, 0
    elif c is None:
        hours, minutes, seconds = (a, b, 0) if days is not None else (0, a, b)
    else:
        hours, minutes, seconds = a, b, c
    return (days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def signal_delay_s(args, stage_name: str) -> int:
    """Seconds of USR1 warning before the time limit: --signal-delay-s, else what the stage's sbatch script asks
    (`#SBATCH --signal=B:USR1@S` in slurm/<stage>.sh: 1200 for cpt_4m, whose step and save take longer), else 600."""
    if args.signal_delay_s is not None:
        return args.signal_delay_s
    script = PROJECT_ROOT / "slurm" / f"{'niah' if stage_name == 'ruler' else stage_name}.sh"  # RULER runs niah.sh
    found = re.search(r"^#SBATCH --signal=B:USR1@(\d+)", script.read_text(), re.M) if script.is_file() else None
    return int(found.group(1)) if found else DEFAULT_SIGNAL_DELAY_S


def slurm_parameters(args, recipe: Recipe, stage: Stage) -> dict:
    """submitit SlurmExecutor parameters of one stage (dependency added at submission)."""
    nodes, per_node = recipe.cluster.nodes, recipe.cluster.gpus_per_node
    params = {
        "job_name": stage.name, "nodes": nodes, "ntasks_per_node": per_node, "time": parse_time(args.time),
        "signal_delay_s": signal_delay_s(args, stage.name), "additional_parameters": {"requeue": True},
        "setup": [f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}",
                  f"export SUBMITIT_PREEMPT_SIGNAL={PREEMPT_SIGNAL}",
                  # the NCCL/IB defaults of the sbatch scripts, overridable in the environment; RANK, WORLD_SIZE, ...
                  # and a MASTER_ADDR the submitting shell exported would win over Slurm's (slurm/common.sh)
                  f"source {shlex.quote(str(PROJECT_ROOT / 'slurm/common.sh'))} && nccl_defaults && check_rendezvous",
                  # since Slurm 22.05 srun does not pass the job's --cpus-per-task on: one CPU per rank otherwise
                  'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi'],
        # as slurm/common.sh: a rank that died ends the others 120 s later, not at the process-group timeout
        # (runtime.timeout_minutes); a rank that exits 3 first (a save for requeue) does not get rank 0 killed
        # before it requeues (sites with KillOnBadExit=1); the job's environment reaches the tasks even under
        # sbatch --export=NONE (srun would inherit SLURM_EXPORT_ENV=NONE)
        "srun_args": ["--kill-on-bad-exit=0", "--wait=120", "--export=ALL"],
    }
    if recipe.runtime.device == "cuda":
        params.update(gpus_per_node=per_node, exclusive=True, cpus_per_task=GPU_CPUS_PER_TASK, mem="0")
    if args.cpus_per_task:
        params["cpus_per_task"] = args.cpus_per_task
    if args.partition:
        params["partition"] = args.partition
    if args.account:
        params["account"] = args.account
    return params


# ---------------------------------------------------------------------------- the job


class TrainStage:
    """The callable each Slurm task runs: `megatron_ext.train.main` on one recipe.

    Checkpointable (submitit calls `checkpoint` on a timeout or preemption signal that arrives
    before the trainer installs its own handler): the resubmitted callable is the same stage, which
    resumes from `checkpoint.dir`.
    """

    def __init__(self, recipe: str, overrides: list[str]):
        self.recipe = recipe
        self.overrides = list(overrides)

    def __call__(self) -> dict:
        import json

        from megatron_ext.train import EXIT_REQUEUE, main

        job = os.environ.get("SLURM_JOB_ID")
        if job:
            try:
                recipe = load_recipe(self.recipe, self.overrides,
                                     world_size=int(os.environ.get("SLURM_NTASKS", "1")))
                if recipe.checkpoint.dir:  # rank 0 records it; every rank checks, so all stop together
                    claim_checkpoint_dir(recipe.checkpoint.dir, job,
                                         write=os.environ.get("SLURM_PROCID", "0") == "0")
            except RecipeError as e:
                raise SystemExit(f"error: {e}") from None
        with requeue_ends_the_task():  # a USR1 before the trainer's own handler is installed: submitit's
            code = main(["--recipe", self.recipe, *self.overrides])
        if code == EXIT_REQUEUE:
            refusal = requeue_refusal()
            if refusal:  # without the bound a stage that never gets further requeues forever
                raise RuntimeError(f"{refusal} (recipe {self.recipe})")
            if int(os.environ.get("SLURM_PROCID", "0")) == 0:
                job = os.environ["SLURM_JOB_ID"]
                print(f"[launch] checkpoint saved; requeueing job {job}", flush=True)
                done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
                if done.returncode != 0:  # the job would end here, with its checkpoint saved but not requeued
                    raise RuntimeError(f"scontrol requeue {job} failed ({done.stderr.strip() or done.returncode}): "
                                       f"the checkpoint is saved; submit the stage again to go on (recipe {self.recipe})")
            # No result file: the job is not over (what submitit itself does after requeueing).
            raise SystemExit(EXIT_REQUEUE)
        if code != 0:
            raise RuntimeError(f"megatron_ext.train exited with {code} (recipe {self.recipe}); see the job log")
        recipe = load_recipe(self.recipe, self.overrides, world_size=int(os.environ.get("SLURM_NTASKS", "1")))
        metrics = Path(recipe.checkpoint.dir) / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return {"stage": recipe.name, "checkpoint_dir": recipe.checkpoint.dir,
                "last": json.loads(lines[-1]) if lines else None}

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(TrainStage(self.recipe, self.overrides))


# ---------------------------------------------------------------------------- CLI


_count = whole_number(1)  # nodes, tasks or CPUs


def _owner_state(text: str) -> tuple[str, str]:
    try:
        return parse_owner_state(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.launch", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True, help="recipe YAML (the first stage, or the folder of --stages)")
    p.add_argument("--stages", help="comma list of recipe names in the folder of --recipe, run in order")
    p.add_argument("--nodes", type=_count, help="nodes per job (default: the recipe's cluster.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="tasks (GPUs) per node (default: cluster.gpus_per_node)")
    p.add_argument("--cpus-per-task", type=_count, help=f"CPUs per task (default: {GPU_CPUS_PER_TASK} "
                                                                 "on cuda, else Slurm's)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--time", default=DEFAULT_TIME, help=f"time limit per job (default {DEFAULT_TIME}; requeues "
                                                         "continue the stage)")
    p.add_argument("--signal-delay-s", type=int, help="USR1 this long before the time limit (default: as the stage's "
                   f"slurm/STAGE.sh asks, e.g. 1200 s for cpt_4m; else {DEFAULT_SIGNAL_DELAY_S})")
    p.add_argument("--folder", default="logs/submitit/%j", help="submitit logs and pickles (%%j: job id)")
    p.add_argument("--niah", metavar="LENGTHS", help="after the last stage, NIAH of its checkpoint at these lengths "
                   "(e.g. 128K:1M:4) on the Megatron engine, at the TP x CP of the longest-sequence stage")
    p.add_argument("--ruler", metavar="LENGTHS", help="also after the last stage, the RULER-style tasks "
                   "(tools/niah.py ruler --tasks all) at these lengths, the same way")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would be submitted")
    p.add_argument("--wait", action="store_true", help="wait for the last stage and print every stage's result")
    p.add_argument("--check", action="store_true", help="only validate the recipe for --world-size tasks "
                                                        "(what slurm/*.sh run before srun)")
    p.add_argument("--world-size", type=int, help="--check: tasks of the job (default: the recipe's cluster size)")
    p.add_argument("--tasks-per-node", type=_count, help="--check: tasks per node")
    p.add_argument("--claim", action="store_true", help="--check: record this Slurm job as the one writing "
                   "checkpoint.dir; fails while another queued or running job holds it (slurm/*.sh do this)")
    p.add_argument("--host-squeue", action="store_true", help="internal, for slurm/common.sh's preflight in a "
                   "container: where squeue cannot tell whether the job holding checkpoint.dir has ended, exit 5 "
                   "with a last line 'claim-owner-unknown: JOBID' so that the batch host asks Slurm")
    p.add_argument("--owner-state", type=_owner_state, action="append", default=[], metavar="JOBID=STATE",
                   help="internal, for slurm/common.sh's preflight: the state squeue on the batch host gave for job "
                   "JOBID (empty: no longer listed), taken in place of asking squeue here, for that job only; an "
                   "ended state hands its checkpoint.dir to this job, so do not pass it by hand")
    p.add_argument("--get", metavar="KEY", help="print one resolved recipe field (e.g. checkpoint.dir) and exit")
    p.add_argument("--check-data", action="store_true", help="only check the recipe's data.prefix datasets (complete, "
                   "ids within model.vocab_size, tokenized with a local model.tokenizer) and exit (slurm/pipeline.sh "
                   "does before it submits)")
    p.add_argument("--check-hf", metavar="DIR", help="only check that the Hugging Face model folder DIR is the "
                   "recipe's model (its sizes: what the convert job makes of it must load into the CPT stage) and exit "
                   "(slurm/pipeline.sh --hf does before it submits)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, or STAGE:dotted.key=value for one stage")
    p.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override given the way tools/plan.py and `recipe check` take them (repeatable; applied "
                   "after the KEY=VALUE ones)")
    return p


def print_field(args) -> int:
    """`--get checkpoint.dir`: the resolved value (for slurm/pipeline.sh)."""
    value = load_recipe(args.recipe, args.overrides).to_dict()
    for key in args.get.split("."):
        if not isinstance(value, dict) or key not in value:
            raise RecipeError(f"--get {args.get}: no such recipe field")
        value = value[key]
    print("" if value is None else value)
    return 0


def submit(args, plan: list[Stage]) -> int:
    """Validate every stage, then print (dry run) or submit the chain."""
    for stage in plan:
        check_warning_fits(args.time, parse_time(args.time), signal_delay_s(args, stage.name))
    # --nodes/--gpus-per-node override the recipe's cluster block, which sizes the job.
    if args.gpus_per_node is not None and args.gpus_per_node < 1:  # an int, not _count: --check takes 0 (CPU jobs)
        raise RecipeError(f"--gpus-per-node {args.gpus_per_node}: must be >= 1 (tasks, one per GPU, on each node)")
    size = [f"cluster.nodes={args.nodes}"] if args.nodes else []
    size += [f"cluster.gpus_per_node={args.gpus_per_node}"] if args.gpus_per_node else []
    jobs_params = []
    for i, stage in enumerate(plan):
        # Later stages read what earlier ones write: their checkpoint paths are checked when they start, their data
        # now (rather than after the stages before them ran); the first stage's paths after the loop.
        recipe = check(stage.recipe, stage.overrides + size, None, paths=False)
        if i and chain_sft_stage(jobs_params[-1][0], recipe, stage):
            recipe = check(stage.recipe, stage.overrides + size, None, paths=False)
        # a GPU job runs one task per GPU (slurm_parameters): the check the sbatch scripts make with Slurm's count
        check_tensor_parallel_within_node(recipe, recipe.cluster.gpus_per_node, f"stage {stage.name}: ")
        if i and not args.dry_run:
            try:
                check_data(recipe)
            except RecipeError as e:
                raise RecipeError(f"stage {stage.name}: {e}") from None
        if i:
            check_stage_follows(jobs_params[-1][0], recipe)
        jobs_params.append((recipe, slurm_parameters(args, recipe, stage)))
    check_stage_order([s.name for s in plan], [r for r, _ in jobs_params])
    if not args.dry_run:
        # Before anything imports submitit (check_submit_folder does): it reads the signal once, at import. Not
        # setdefault: the tasks get USR1 (the job setup above), so Slurm must be asked for USR1 too; another signal
        # (submitit's default USR2, or one from the user's shell) would kill every rank unsaved at the time limit.
        os.environ["SUBMITIT_PREEMPT_SIGNAL"] = PREEMPT_SIGNAL
        check_setup(jobs_params[0][0])
        check_metrics_file(jobs_params[0][0].checkpoint.dir)
        check_submit_folder(args.folder)
    evals = eval_jobs(args, [r for r, _ in jobs_params], lambda a, r, name: slurm_parameters(a, r, Stage(name, "")))

    if args.dry_run:
        print("(dry run: the recipes are validated; data, init_from and checkpoint paths are not: --check does)")
        for i, (stage, (recipe, params)) in enumerate(zip(plan, jobs_params)):
            world = params["nodes"] * params["ntasks_per_node"]
            print(f"stage {i + 1}/{len(plan)} {stage.name}: {stage.recipe}")
            print(f"  layout: {describe(recipe, world)}")
            shown = {k: v for k, v in params.items() if k != "setup"}
            if i:
                shown = after(shown, f"<job of stage {i}>")
            for key in sorted(shown):
                print(f"  sbatch {key}: {shown[key]}")
            for line in params["setup"]:
                print(f"  setup: {line.replace(str(PROJECT_ROOT), '<project>')}")
            run = ["python", "-m", "megatron_ext.train", "--recipe", stage.recipe, *stage.overrides]
            print(f"  run per task: {shlex.join(run)}")
        for stage, params in evals:
            previous = f"stage {len(plan)}"
            print(f"then {stage.name}: {params['nodes'] * params['ntasks_per_node']} processes, after {previous}")
            shown = after(params, f"<job of {previous}>")
            for key in sorted(k for k in shown if k != "setup"):
                print(f"  sbatch {key}: {shown[key]}")
            print(f"  run per task: {shlex.join(['python', 'tools/niah.py', *stage.argv])}")
        return 0

    import submitit

    jobs, submitted = [], Submitted()
    for stage, (recipe, params) in zip(plan, jobs_params):
        executor = submitit.SlurmExecutor(folder=args.folder, max_num_timeout=50)
        executor.update_parameters(**(after(params, jobs[-1].job_id) if jobs else params))
        job = submitted.submit(executor, stage.name, args.folder, TrainStage(stage.recipe, stage.overrides))
        print(f"submitted {stage.name}: job {job.job_id} ({describe(recipe, params['nodes'] * params['ntasks_per_node'])})",
              flush=True)
        jobs.append(job)
    trained = jobs[-1].job_id
    for stage, params in evals:  # each after the last stage, like slurm/pipeline.sh: one failing stops no other
        executor = submitit.SlurmExecutor(folder=args.folder, max_num_timeout=50)
        executor.update_parameters(**after(params, trained))
        jobs.append(submitted.submit(executor, stage.name, args.folder, stage))
        plan = [*plan, Stage(stage.name, "")]
        print(f"submitted {stage.name}: job {jobs[-1].job_id} ({shlex.join(['tools/niah.py', *stage.argv])})",
              flush=True)
    if args.wait:
        training = len(jobs) - len(evals)
        failed = 0
        for i, (stage, job) in enumerate(zip(plan, jobs)):
            try:
                result = job.results()[0]  # global rank 0's
            except Exception as e:  # submitit's job errors carry the task's traceback
                # a training stage's failure leaves every later job's afterok unsatisfiable; an evaluation's none
                later = jobs[i + 1:] if i < training else []
                for other in later:
                    other.cancel(check=False)
                print(f"error: stage {stage.name} (job {job.job_id}) failed; cancelled {len(later)} later "
                      f"stage(s); log: {job.paths.stdout}\n{str(e)[-2000:]}", file=sys.stderr)
                if later:
                    return 1
                failed += 1
                continue
            print(f"done {stage.name}: job {job.job_id}: {result}", flush=True)
        return 1 if failed else 0
    return 0


def check_hf_model(folder: str, recipe: Recipe) -> None:
    """RecipeError where the HF model in `folder` is not `recipe`'s model (hidden size, layers, heads, vocabulary,
    tied embeddings): its conversion would fail the CPT stage only when that starts, after the convert job and the
    queue wait."""
    from megatron_ext.resume import architecture_changes

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"--hf {folder}: cannot read {path} ({getattr(e, 'strerror', None) or e}); give the Hugging "
                          "Face model folder to convert") from None
    if not isinstance(config, dict):
        raise RecipeError(f"--hf {folder}: {path} is not a JSON object; give the Hugging Face model folder to convert")
    changed = architecture_changes(config, recipe)
    if changed:
        raise RecipeError(f"--hf {folder} is another model than recipe {recipe.name}'s ({'; '.join(changed)}, as "
                          "'model folder -> recipe'): give the model the recipe extends, or a recipe of this model")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    args.overrides += args.set_overrides
    try:
        if args.check and args.get:  # --check answered alone, --get silently dropped
            raise RecipeError("--check and --get: give one (--get prints a field of a recipe that loads)")
        if args.check:
            return run_check(args)
        if args.get:
            return print_field(args)
        if args.check_data:
            check_data(load_recipe(args.recipe, args.overrides))
            return 0
        if args.check_hf:
            check_hf_model(args.check_hf, load_recipe(args.recipe, args.overrides))
            return 0
        return submit(args, plan_stages(args.recipe, args.stages, args.overrides))
    except (RecipeError, EvalError, SubmissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
