"""The evaluation jobs `python -m megatron_ext.launch --niah LENGTHS --ruler LENGTHS` adds after the last stage:
`tools/niah.py` (NIAH grid) and `tools/niah.py ruler` (RULER-style tasks) on the Megatron engine, one Slurm task
per rank, at the TP x CP of the stage with the longest sequences, chat prompts after an SFT stage, results in
`<checkpoint.dir>_niah/` and `<checkpoint.dir>_ruler/`. slurm/pipeline.sh --niah/--ruler submit the same."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.recipe import Recipe, RecipeError


@dataclass(frozen=True)
class Evaluation:
    """One kind of evaluation job: its tools/niah.py command, fixed arguments and results file."""

    name: str
    command: tuple[str, ...]
    arguments: tuple[str, ...]
    results: str


EVALUATIONS = (Evaluation("niah", (), ("--depths", "0:100:10"), "results.json"),
               Evaluation("ruler", ("ruler",), ("--tasks", "all"), "ruler.json"))


class EvalStage:
    """The callable each task of an evaluation job runs: `tools/niah.py` with these arguments.

    Checkpointable: on the time-limit warning or a preemption (USR1) submitit asks rank 0 for `checkpoint` and
    requeues the job with what it returns, the same evaluation with `--resume`: it keeps the cells the results file
    has (saved after each length and every minute) and runs the others.
    """

    def __init__(self, name: str, argv: list[str], results: str):
        self.name, self.argv, self.results = name, list(argv), results

    def __call__(self) -> dict:
        from megatron_ext.evaluate.cli import main
        from megatron_ext.slurm_jobs import requeue_ends_the_task

        argv = self.argv
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 and "--resume" not in argv:
            # requeued by Slurm itself (node failure, scontrol requeue, preemption), not through `checkpoint`: go on
            # from the saved cells, as slurm/niah.sh does (without it the earlier results would be refused)
            argv = [*argv, "--resume"]
        with requeue_ends_the_task():
            main(argv)  # a mistake ends in SystemExit("error: ..."), which submitit reports
        out = Path(self.argv[self.argv.index("--out") + 1])
        path = out / self.results
        result = json.loads(path.read_text()) if path.is_file() else {}
        return {"stage": self.name, "out": str(out), "accuracy": result.get("accuracy")}

    def checkpoint(self, *args, **kwargs):
        import submitit

        argv = self.argv if "--resume" in self.argv else [*self.argv, "--resume"]
        return submitit.helpers.DelayedSubmission(EvalStage(self.name, argv, self.results))


def check_lengths(option: str, spec: str, last: Recipe | None = None) -> None:
    """RecipeError naming `option` when `spec` is not a list of lengths, or (with the last stage's recipe) holds a
    length beyond its model's max_position_embeddings: found before anything is submitted, not by the evaluation
    job after the training (it skipped such lengths, or failed, and then the export after it was cancelled)."""
    from megatron_ext.evaluate.cli_args import parse_lengths

    try:
        lengths = parse_lengths(spec)
    except EvalError as e:
        raise RecipeError(f"{option} {spec!r}: {str(e).removeprefix('--lengths: ')}") from None
    if last is None:
        return
    limit = last.max_position_embeddings
    beyond = [n for n in lengths if n > limit]
    if beyond:
        raise RecipeError(f"{option} {spec!r}: {', '.join(f'{n:,}' for n in beyond)} tokens is beyond the last "
                          f"stage's model.max_position_embeddings = {limit:,} ({last.name}); evaluate at most that")


def tasks_per_node(ranks: int, tensor: int, slots: int) -> int:
    """Tasks per node of an evaluation job of `ranks` (TP x CP) processes on nodes of `slots` GPUs: the most, up to
    `slots`, that divides `ranks`, so that the job has exactly `ranks` tasks (TP 2 x CP 4 on 6-GPU nodes got 2 x 6
    = 12 tasks for 8 ranks: a job that fails as it starts, after the training), whole TP groups on a node where
    that can be. slurm/pipeline.sh sizes its evaluation jobs the same way."""
    fits = [n for n in range(min(ranks, slots), 0, -1) if ranks % n == 0]
    return next((n for n in fits if n % tensor == 0), fits[0])


def eval_jobs(args, recipes: list[Recipe], slurm_parameters) -> list[tuple[EvalStage, dict]]:
    """(what each task runs, submitit parameters) of the evaluations asked for (`--niah`, `--ruler`), each after the
    last stage. `slurm_parameters(args, recipe, name)` sizes a job like the stage's."""
    jobs = []
    last, longest = recipes[-1], max(recipes, key=lambda r: r.train.seq_length)
    tp, cp = longest.parallel.tensor, longest.parallel.context
    per_node = tasks_per_node(tp * cp, tp, longest.cluster.gpus_per_node)
    for ev in EVALUATIONS:
        lengths = getattr(args, ev.name)
        if not lengths:
            continue
        check_lengths(f"--{ev.name}", lengths, last)
        out = str(last.checkpoint.dir).rstrip("/") + f"_{ev.name}"
        if not args.dry_run and (Path(out) / ev.results).exists():  # the job would refuse it after the training
            raise RecipeError(f"--{ev.name}: {out} holds an earlier evaluation's {ev.results}, which the {ev.name} "
                              "job does not overwrite; move or remove that folder first")
        argv = [*ev.command, "--megatron", str(last.checkpoint.dir), "--engine", "megatron", "--tp", str(tp),
                "--cp", str(cp), "--lengths", lengths, *ev.arguments, "--out", out, "--no-progress"]
        argv += ["--chat"] if last.train.stage == "sft" else []
        params = slurm_parameters(args, longest, ev.name)  # with the USR1 warning and requeue: see EvalStage
        params.update(job_name=ev.name, nodes=-(-tp * cp // per_node), ntasks_per_node=per_node)
        if "gpus_per_node" in params:
            params["gpus_per_node"] = per_node
        jobs.append((EvalStage(ev.name, argv, ev.results), params))
    return jobs


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_ext.launch_eval OPTION LENGTHS [RECIPE [dotted.key=value ...]]`: one error line and status
    1 when LENGTHS is not a list of lengths or goes beyond the model of RECIPE, the last stage's (slurm/pipeline.sh
    checks --niah and --ruler before it submits anything)."""
    import sys

    from megatron_ext.recipe import load_recipe

    argv = sys.argv[1:] if argv is None else argv
    asked = argv[:1] in (["-h"], ["--help"])
    if asked or len(argv) < 2:
        print("usage: python -m megatron_ext.launch_eval OPTION LENGTHS [RECIPE [dotted.key=value ...]]",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    option, spec, rest = argv[0], argv[1], argv[2:]
    try:
        check_lengths(option, spec, load_recipe(rest[0], rest[1:]) if rest else None)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
