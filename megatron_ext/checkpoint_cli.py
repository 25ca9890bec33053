"""`tools/checkpoint.py info DIR`: what a checkpoint holds, whether it is complete (and, `--verify`, undamaged), and
what a run would do with it (`--recipe`): resume model, optimizer and data position, the weights only, or nothing.
`tools/checkpoint.py reshard DIR --out NEW`: its distributed-optimizer state saved again for any layout
(megatron_ext.checkpoint_reshard). Ctrl-C / SIGTERM end either in one line and exit 130 / 143; an interrupted reshard
leaves no --out."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_ext.checkpoint_damage import FIX as DAMAGE_FIX
from megatron_ext.checkpoint_damage import verify_contents
from megatron_ext.checkpoint_index import (CheckpointError, check_complete, read_dcp_index, saved_bucket_size,
                                           saved_fully_reshardable)
from megatron_ext.checkpoint_layout import (available_iterations, checked_metadata, latest_iteration,
                                            resolve_iteration_dir, unfinished_saves)
from megatron_ext.cli_types import whole_number
from megatron_ext.recipe import RecipeError, load_recipe
from megatron_ext.resume import Resume, plan_resume


def _layout(d: dict | None) -> str:
    if not d:
        return "not recorded"
    return " x ".join(f"{k[0].upper()}P {d.get(k)}" for k in ("tensor", "pipeline", "context", "data"))


def _buckets_of(meta: dict) -> str:
    """' (one gradient bucket)' or ' (gradient buckets of N parameters)' for a distributed-optimizer checkpoint
    saved dp_reshardable, whose state follows them; ' (saved fully_reshardable)' for one saved for any layout;
    '' otherwise."""
    if not ((meta.get("recipe") or {}).get("train") or {}).get("distributed_optimizer"):
        return ""
    if saved_fully_reshardable(meta):
        return " (saved fully_reshardable)"
    size = saved_bucket_size(meta)
    return " (one gradient bucket)" if size is None else f" (gradient buckets of {size:,} parameters)"


def describe(root: Path, iteration: int | None = None, verify: bool = False) -> tuple[list[str], int, dict, str | None]:
    """Printable lines about `root`'s checkpoint `iteration` (latest if None), that iteration, its metadata and
    what stops a run from loading it (None when nothing does): incomplete, or with `verify` (every stored byte read
    and its CRC-32 checked) damaged."""
    iteration, path = resolve_iteration_dir(root, iteration, iteration_option="--iteration")
    meta = checked_metadata(path)
    unusable = None
    try:
        check_complete(path)
        files = sorted(p for p in path.iterdir() if p.is_file())
        size = sum(p.stat().st_size for p in files)
        shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
        state = f"complete ({len(files)} files, {shown}; "
        if not verify:
            # a damaged byte in a tensor loads without a word (torch does not check the CRC): checkpoint_damage.py
            state += "their sizes checked, not their contents: --verify reads them)"
        elif damaged := verify_contents(path, read_dcp_index(path)):
            state = f"DAMAGED: {'; '.join(f'{name}: {what}' for name, what in damaged)}"
            unusable = f"damaged (above); {DAMAGE_FIX}"
        else:
            state += "contents read, every stored item's CRC-32 checked)"
    except CheckpointError as e:
        state = f"INCOMPLETE: {str(e).split('incomplete checkpoint: ', 1)[-1]}"
        unusable = "incomplete (above); no run can load it"
    recipe, hf = meta.get("recipe") or {}, meta.get("hf_config") or {}
    train, versions = recipe.get("train") or {}, meta.get("versions") or {}
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    lines = [
        f"checkpoint {root}: iterations {available_iterations(root)}, latest {latest_iteration(root)}",
        f"{path.name}: {state}",
        f"  saved {meta.get('created', '?')}, git {meta.get('git_sha') or '?'}, megatron-core "
        f"{versions.get('megatron-core', '?')}, torch {versions.get('torch', '?')}",
        f"  layout {_layout(meta.get('parallel'))}, distributed optimizer "
        f"{train.get('distributed_optimizer', '?')}{_buckets_of(meta)}, optimizer state "
        f"{meta.get('has_optimizer', '?')}",
        f"  position: step {iteration}, {meta['consumed_samples']:,} samples, {meta['tokens']:,} tokens"
        if "consumed_samples" in meta else f"  position: step {iteration} (samples and tokens not recorded)",
        f"  model: {hf.get('num_hidden_layers', '?')} layers, hidden {hf.get('hidden_size', '?')}, heads "
        f"{hf.get('num_attention_heads', '?')}/{hf.get('num_key_value_heads', '?')}, vocab {hf.get('vocab_size', '?')}, "
        f"rope {rope.get('rope_type', 'default')} factor {rope.get('factor', 1)}"
        + (f", angles {hf['rope_angle_precision']}" if hf.get("rope_angle_precision") else ""),
    ]
    unfinished = unfinished_saves(root)
    if unfinished:
        lines.insert(1, f"unfinished saves {unfinished}: being written (checkpoint.async_save) or interrupted; "
                        "never loaded, replaced by the next save of that iteration")
    if train:
        lines.append(f"  recipe {recipe.get('name', '?')}: stage {train.get('stage')}, seq {train.get('seq_length')}, "
                     f"global batch {train.get('global_batch_size')}, steps {train.get('steps')}, lr {train.get('lr')}")
    return lines, iteration, meta, unusable


def verdict(r: Resume, steps: int) -> list[str]:
    """What the trainer would do, in the words of its log."""
    if r.stage_refusal:
        return [f"  would stop: {r.stage_refusal}"]
    if r.architecture_changed:
        return ["  would stop: the recipe's model differs from the checkpoint's (" + "; ".join(r.architecture_changed)
                + "); use the checkpoint's architecture or another checkpoint.dir"]
    if r.finished:
        return [f"  nothing to train: the checkpoint is at step {r.step}, train.steps = {steps}"]
    out = [f"  resumes at step {r.step} -> {steps}: " + (
        "model, optimizer and scheduler" if r.full_state else f"the weights, with a fresh optimizer state ({r.why_not_full})")
        + f"; reads on from sample {r.consumed_samples:,}"]
    if r.saved_layout != r.layout:
        out.append(f"  layout {_layout(r.saved_layout)} -> {_layout(r.layout)}")
    if r.data_changed:
        out.append("  warning: " + "; ".join(r.data_changed) + " (another sample order)")
    out += [f"  warning: {w}" for w in (r.order_warning, r.schedule_warning) if w]
    if r.rope_changed:
        out.append("  warning: RoPE " + "; ".join(r.rope_changed) + " (positions the weights were not trained with)")
    return out


_ITERATION = whole_number(0, "an iteration is a step number")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/checkpoint.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a checkpoint; with --recipe, what a run would do with it (exit 1 when "
                          "the iteration is incomplete, or damaged under --verify)")
    info.add_argument("dir", help="checkpoint.dir of a run (the folder with iter_* and latest_checkpointed_iteration.txt)")
    info.add_argument("--iteration", type=_ITERATION, default=None, help="an iteration other than the latest")
    info.add_argument("--recipe", help="recipe YAML of the run that would resume from DIR")
    info.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="dotted recipe override (repeatable)")
    info.add_argument("--world-size", type=int, default=None, help="processes of that run (default: cluster size)")
    info.add_argument("--verify", action="store_true", help="read every stored byte and check each item's CRC-32 "
                      "(after a copy: a damaged byte in a tensor otherwise loads without a word)")
    reshard = sub.add_parser("reshard", help="save a checkpoint's distributed-optimizer state again, "
                             "fully_reshardable (any TP, PP and gradient buckets resume it); on a multiple of TP x PP "
                             "processes")
    reshard.add_argument("dir", help="checkpoint.dir of a run, or one of its iter_* folders: one your own runs wrote "
                         "(torch unpickles the optimizer state and extra state stored in its shards)")
    reshard.add_argument("--out", required=True, help="a new folder: the checkpoint.dir to resume from afterwards")
    reshard.add_argument("--iteration", type=_ITERATION, default=None, help="an iteration other than the latest")
    args = parser.parse_args(argv)
    from megatron_ext.runtime.signals import Terminated, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():  # scancel / kill as Ctrl-C: reshard's cleanup runs
            return _reshard(args) if args.command == "reshard" else _info(args)
    except KeyboardInterrupt as e:
        # in torch's import, the load or the save: reshard has removed its staging folder, --out is not made
        how, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        made = (f"; nothing written (--out {args.out} is made only by a complete reshard)"
                if args.command == "reshard" else "")
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # torchrun signals every rank
            print(f"error: interrupted ({how}){made}", file=sys.stderr)
        return code


def _info(args: argparse.Namespace) -> int:
    if not args.recipe and (args.overrides or args.world_size is not None):
        print("error: --set and --world-size describe the run of --recipe; give --recipe FILE too", file=sys.stderr)
        return 1
    try:
        lines, iteration, meta, unusable = describe(Path(args.dir), args.iteration, verify=args.verify)
        if args.recipe:
            recipe = load_recipe(args.recipe, args.overrides, world_size=args.world_size)
            p = recipe.parallel
            world = args.world_size if args.world_size is not None else recipe.cluster.nodes * recipe.cluster.gpus_per_node
            dp = world // (p.tensor * p.pipeline * p.context)
            lines.append(f"with {args.recipe} on {world} processes:")
            lines += verdict(plan_resume(meta, iteration, recipe, dp, root=args.dir), recipe.train.steps)
    except (CheckpointError, RecipeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    if unusable:  # for scripts: a checkpoint not to load
        print(f"error: {args.dir}: iteration {iteration} is {unusable}", file=sys.stderr)
        return 1
    return 0


def _reshard(args) -> int:
    from megatron_ext.checkpoint_reshard import reshard
    from megatron_ext.runtime import DeviceError, process_env

    try:
        final = reshard(args.dir, args.out, args.iteration)
    except (CheckpointError, RecipeError, DeviceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if process_env().rank == 0:
        print(f"saved {final} with the optimizer state fully_reshardable: resume from checkpoint.dir={args.out} at "
              "any TP, PP, CP, DP and gradient buckets")
    return 0
