"""Does a recipe fit a GPU cluster, and how long will it take?

tools/plan.py's command line (the model is megatron_ext.plan, megatron_ext.eval_plan):

    python tools/plan.py recipes/cpt_4m.yaml [--gpu h100|h200|b200] [--gpus 256] [--mfu 0.35] [--set k=v]
    python tools/plan.py recipes/cpt_4m.yaml --eval 128K:4M:6 [--gpus 64 --tp 8 --cp 8] [--prompts 11]

Prints the per-GPU memory breakdown, the verdict, tokens/s/GPU and the hours for the recipe's
steps, the smallest context-parallel size that fits for each recompute mode and a recommendation.
With --eval: the same for evaluating the recipe's model on the Megatron engine at the recipe's TP x PP x CP
(`tools/niah.py --engine megatron`): memory per GPU, time of a prompt and of a grid, per length.
Exits 1 with the reason when the recipe does not fit or the input is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from megatron_ext.cost_model import GB, GPUS, RECOMPUTE_MODES, Shape, padded_vocab, resolve_gpu
from megatron_ext.eval_plan import eval_plan, eval_report, min_eval_context
from megatron_ext.plan import PAPER_HOURS, Plan, kernels_of, min_context, plan, recommend
from megatron_ext.recipe import RecipeError, load_recipe


def loss_head_label(p: Plan) -> str:
    t = p.recipe.train
    if t.loss_head == "chunked":
        return f"loss head (chunked, {t.loss_chunk_tokens} tok)"
    return "logits (fused CE, assumed)" if p.fused_ce else "logits + loss (fp32)"


def report(p: Plan, mfu: float) -> tuple[str, Plan | None]:
    """Printable table for one plan, and the recommended plan (None when nothing fits)."""
    r, m, t = p.recipe, p.memory, p.timing
    tokens = r.train.steps * r.train.global_batch_size * r.train.seq_length
    gb = lambda x: f"{x / GB:8.2f} GB"  # noqa: E731
    overlapped = [what for what, on in (("grad reduce", r.train.overlap_grad_reduce),
                                         ("param gather", r.train.overlap_param_gather)) if on]
    lines = [
        f"plan: {r.name}  on {p.gpus} x {p.gpu.name}  (TP {p.tensor} x PP {p.pipeline} x CP {p.context} x DP {p.data}),"
        f" seq {r.train.seq_length:,}, global batch {r.train.global_batch_size}, recompute {p.recompute_label},"
        f" kernels {kernels_of(r)}",
        "  memory per GPU",
        f"  {'weights':<34}{gb(m.weights)}",
        f"  {'gradients (fp32 main grads)':<34}{gb(m.grads)}",
        f"  {'optimizer (sharded over DP x CP)':<34}{gb(m.optimizer)}",
        f"  {'activations':<34}{gb(m.activations)}   ({r.train.seq_length // p.context:,} tokens/GPU)",
        f"  {loss_head_label(p):<34}{gb(m.logits)}",
        f"  {'RoPE tables':<34}{gb(m.rope)}",
        f"  {'CP ring buffers' if kernels_of(r) == 'te' else 'CP gathered K/V gradients':<34}{gb(m.cp_buffers)}",
        f"  {'sequence-parallel gathers':<34}{gb(m.sp_buffers)}",
        f"  {'CUDA/NCCL/allocator overhead':<34}{gb(m.overhead)}",
        f"  {'total':<34}{gb(m.total)}   of {p.gpu.memory_gb:g} GB: "
        + ("FITS" + (" (tight, > 90%)" if p.tight else "") if p.fits else "DOES NOT FIT"),
        "  time",
        f"  {'model FLOPs per token (causal)':<34}{t.flops_per_token / 1e9:8.1f} GFLOP",
        f"  {'step: compute':<34}{t.compute_s:8.2f} s   (at {mfu:.0%} of {p.gpu.bf16_tflops:g} TFLOP/s BF16)",
        f"  {'step: TP / CP(exposed) / DP comm':<34}{t.tp_comm_s:8.2f} / {t.cp_comm_s:.2f} / {t.dp_comm_s:.2f} s"
        + (f"   (DP overlapped: {' and '.join(overlapped)})" if overlapped else ""),
        f"  {'step time':<34}{t.step_s:8.2f} s",
        f"  {'tokens/s/GPU':<34}{t.tokens_per_s_per_gpu:8.1f}     (achieved MFU {t.mfu:.1%})",
        *([f"  {'validation (forward only)':<34}{t.validation_s:8.2f} s   x {t.validations} "
           f"({r.train.eval_iters} global batch(es) each, train.eval_interval {r.train.eval_interval})"]
          if t.validations else []),
        f"  {'total for ' + str(r.train.steps) + ' steps':<34}{t.hours:8.2f} h  "
        f"({tokens / 1e9:.2f}B tokens)",
        f"  {'per 1B tokens':<34}{t.hours * 1e9 / tokens:8.2f} h",
    ]
    paper, paper_seq = PAPER_HOURS.get(r.name, (None, None))
    if paper and p.gpus == 256 and p.gpu.name == "h100-80gb" and r.train.seq_length == paper_seq:
        lines.append(f"  {'paper (256 x H100, [S2] UNCONFIRMED)':<34}{paper:8.2f} h  "
                     f"(predicted / paper = {t.hours / paper:.2f})")
    mins = {rc: min_context(r, p.gpu, p.gpus, rc, p.fused_ce) for rc in RECOMPUTE_MODES}
    lines.append("  smallest CP that fits: " + ", ".join(
        f"recompute {rc}: {cp if cp else 'none fits'}" for rc, cp in mins.items())
        + f" (memory alone; global batch {r.train.global_batch_size} needs DP <= {r.train.global_batch_size})")
    best = recommend(r, p.gpu, p.gpus, mfu, p.fused_ce)
    if best is None:
        lines.append(f"  recommendation: no CP/recompute fits {p.gpus} x {p.gpu.name} with global batch "
                     f"{r.train.global_batch_size}; add GPUs, use a larger GPU or shorten train.seq_length")
    else:
        lines.append(f"  recommendation: parallel.context={best.context} {best.recompute_overrides}"
                     f" ({best.memory.total / GB:.1f} GB, {best.timing.hours:.2f} h for {r.train.steps} steps)"
                     + (" - tight: above 90% of the memory, nothing below fits" if best.tight else ""))
    return "\n".join(lines), best


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # a dotted.key=value override, not a recipe path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("positionals", nargs="*", metavar="RECIPE | KEY=VALUE",
                        help="recipe YAML (or --recipe) and overrides as the trainer takes them, in any order")
    parser.add_argument("--recipe", dest="recipe_opt", metavar="FILE", help="recipe YAML")
    parser.add_argument("--gpu", help=f"GPU model (default: cluster.gpu): {', '.join(GPUS)} or h100/h200/b200")
    parser.add_argument("--gpus", type=int, help="number of GPUs (default: cluster.nodes x cluster.gpus_per_node)")
    parser.add_argument("--mfu", type=float, default=0.35,
                        help="fraction of BF16 peak the kernels sustain (default 0.35, perf.md §5a)")
    parser.add_argument("--fused-ce", action="store_true", help="with train.loss_head=full: assume a fused cross-entropy (2 B x V/TP per token)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted recipe override, e.g. --set parallel.context=8 (repeatable; of a key "
                        "given twice the last applies, positional overrides counting before --set's)")
    evaluation = parser.add_argument_group("evaluation on the Megatron engine (tools/niah.py --engine megatron)")
    evaluation.add_argument("--eval", metavar="LENGTHS", help="prompt lengths, e.g. 128K,1M,4M or 128K:4M:6")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--cp", "context")):
        evaluation.add_argument(flag, type=int, default=None, help=f"{what} parallel size of the evaluation "
                                f"(default: the recipe's parallel.{what})")
    evaluation.add_argument("--prompts", type=int, default=11, help="prompts per length (default 11: NIAH depths "
                            "0:100:10)")
    evaluation.add_argument("--new-tokens", type=int, default=16, help="decode steps per prompt (default 16, NIAH's "
                            "--max-new-tokens; a model that retrieves with the needle as draft needs none)")
    args = parser.parse_intermixed_args(argv)
    # RECIPE is the first positional that is not a KEY=VALUE override; the others are overrides, before --set's
    files = [a for a in args.positionals if not _OVERRIDE.match(a) or Path(a).exists()]
    args.recipe_file = files[0] if files else None
    args.overrides = [a for a in args.positionals if a is not args.recipe_file] + args.overrides
    if args.recipe_file and args.recipe_opt and args.recipe_file != args.recipe_opt:
        sys.exit(f"error: two recipes, {args.recipe_file} and --recipe {args.recipe_opt}: give one")
    if args.eval:
        return _plan_eval(args)
    if (args.tp, args.pp, args.cp) != (None, None, None) or (args.prompts, args.new_tokens) != (11, 16):
        sys.exit("error: --tp, --pp, --cp, --prompts and --new-tokens plan an evaluation: add --eval LENGTHS "
                 "(for training use --set parallel.context=N)")
    path = args.recipe_opt or args.recipe_file
    try:
        if path is None:
            raise RecipeError("no recipe given; pass RECIPE or --recipe FILE (see recipes/)")
        if args.gpus is not None and args.gpus < 1:
            raise RecipeError(f"--gpus = {args.gpus}: must be >= 1")
        recipe = load_recipe(path, args.overrides, world_size=args.gpus)
        if args.fused_ce and recipe.train.loss_head != "full":  # the chunked head forms no full logits to fuse
            raise RecipeError(f"--fused-ce: plans Megatron's loss head (train.loss_head = full), but the recipe's is "
                              f"{recipe.train.loss_head!r}; add --set train.loss_head=full, or leave out --fused-ce")
        gpu = resolve_gpu(args.gpu or recipe.cluster.gpu)
        planned = plan(recipe, gpu, args.gpus, args.mfu, fused_ce=args.fused_ce)
        text, best = report(planned, args.mfu)
    except RecipeError as e:
        sys.exit(f"error: {path}: {e}" if path is not None else f"error: {e}")
    print(text)
    if not planned.fits:
        need = f"needs {planned.memory.total / GB:.1f} GB per GPU, more than the {gpu.memory_gb:g} GB of {gpu.name}"
        chunked = ""
        if recipe.train.loss_head == "full":
            alt = plan(dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, loss_head="chunked")),
                       gpu, args.gpus, args.mfu)
            if alt.fits:
                chunked = f"; or --set train.loss_head=chunked (fits in {alt.memory.total / GB:.1f} GB at this layout)"
        if best is None:
            sys.exit(f"error: {path}: {need}, and no context-parallel size or recompute mode fits "
                     f"{planned.gpus} GPUs; add GPUs, use a larger GPU or shorten train.seq_length{chunked}")
        sets = " ".join(f"--set {o}" for o in f"parallel.context={best.context} {best.recompute_overrides}".split())
        sys.exit(f"error: {path}: {need}; use {sets} (fits in {best.memory.total / GB:.1f} GB){chunked}")
    return 0


def _plan_eval(args) -> int:
    from megatron_ext.evaluate.cli import parse_lengths
    from megatron_ext.evaluate.errors import EvalError

    path = args.recipe_opt or args.recipe_file
    try:
        if path is None:
            raise RecipeError("no recipe given; pass RECIPE or --recipe FILE (see recipes/): its model and layout")
        for flag, value, least in (("--gpus", args.gpus, 1), ("--tp", args.tp, 1), ("--pp", args.pp, 1),
                                   ("--cp", args.cp, 1), ("--prompts", args.prompts, 1),
                                   ("--new-tokens", args.new_tokens, 0)):
            if value is not None and value < least:
                raise RecipeError(f"{flag} = {value}: must be >= {least}")
        try:
            lengths = parse_lengths(args.eval)
        except EvalError as e:
            raise RecipeError(str(e).replace("--lengths", "--eval")) from None
        recipe = load_recipe(path, args.overrides)  # the training batch rules do not apply to evaluation
        gpu = resolve_gpu(args.gpu or recipe.cluster.gpu)
        gpus = args.gpus or recipe.cluster.nodes * recipe.cluster.gpus_per_node
        shape, par = Shape.from_recipe(recipe), recipe.parallel
        tp, pp, cp = (given if given is not None else default for given, default in
                      ((args.tp, par.tensor), (args.pp, par.pipeline), (args.cp, par.context)))
        layout = {"gpus": gpus, "tensor": tp, "pipeline": pp, "mfu": args.mfu, "kernels": kernels_of(recipe),
                  "vocab_rows": padded_vocab(shape.vocab, recipe.model.make_vocab_size_divisible_by, tp)}
        plans = [eval_plan(shape, gpu, n, context=cp, **layout) for n in lengths]
    except RecipeError as e:
        sys.exit(f"error: {path}: {e}")
    print(eval_report(plans, args.prompts, args.new_tokens, args.mfu, shape))
    if not plans[-1].fits:
        fit = min_eval_context(shape, gpu, lengths[-1], **layout)
        need = (f"{lengths[-1]:,} tokens need {plans[-1].memory.total / GB:.1f} GB per GPU at CP {cp}, more "
                f"than the {gpu.memory_gb:g} GB of {gpu.name}")
        if fit is None:
            sys.exit(f"error: {path}: {need}, and no CP fits {gpus} GPUs at TP {tp}: add GPUs or raise --tp")
        sys.exit(f"error: {path}: {need}; use --cp {fit} (tools/niah.py --cp {fit})")
    return 0
