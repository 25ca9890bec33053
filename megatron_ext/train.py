"""The training loop (CPT and SFT) on Megatron-Core.

    torchrun --nproc_per_node=N -m megatron_ext.train --recipe recipes/tiny/cpt.yaml [dotted.key=value ...]
    srun python -m megatron_ext.train --recipe recipes/cpt_4m.yaml

Megatron-Core pieces: GPTModel, DistributedDataParallel, the (distributed) optimizer,
OptimizerParamScheduler, `get_forward_backward_func` schedules, `finalize_model_grads` and
`dist_checkpointing`. The loss is the exact token mean over all DP x CP ranks and microbatches
(`calculate_per_token_loss`): each microbatch returns its loss *sum* and token count and
`finalize_model_grads` divides the gradients by the global token count.

Exit codes: 0 done; 1 user error (one line on stderr); `EXIT_REQUEUE` (= 3) after SIGTERM/SIGUSR1/SIGUSR2,
once a checkpoint is written, so that the Slurm scripts requeue the job (not after a USR2 stop,
slurm/common.sh); `EXIT_DIVERGED` (= 4) at the first step whose loss or gradient norm is not finite,
without saving: the newest checkpoint is from before (a requeue would only repeat the divergence);
`EXIT_INTERRUPTED` (= 130) after Ctrl-C: saved at the end of the step in the loop, unsaved before it or
at a second Ctrl-C. Each ends in one line; signals after it change neither the status nor the log.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch and Megatron-Core are imported below (seconds): see train_stop
    from megatron_ext.train_stop import catch_signals_while_starting

    catch_signals_while_starting()

import argparse
import math
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

from megatron_ext.recipe import Recipe, RecipeError, load_recipe
from megatron_ext.runtime.distributed import rank_device
from megatron_ext.runtime.signals import interrupt_behind
from megatron_ext.train_metrics import LogWindow, MetricsLog, format_duration, log, memory_gib
from megatron_ext.train_setup import check_setup, out_of_memory, out_of_memory_advice, setup_warnings
from megatron_ext.train_step import forward_step, reduce_loss, validation_loss
from megatron_ext.train_stop import EXIT_INTERRUPTED, StopFlag, any_rank, say_stopped_unsaved

EXIT_REQUEUE = 3
EXIT_DIVERGED = 4


# ---------------------------------------------------------------------------- setup


def build_optimizer(recipe: Recipe, model_chunks: list):
    """Megatron optimizer (AdamW, fp32 master weights for bf16) and LR/WD scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = recipe.train
    config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=t.precision == "bf16",
        params_dtype=torch.bfloat16 if t.precision == "bf16" else torch.float32,
        use_distributed_optimizer=t.distributed_optimizer, overlap_param_gather=t.overlap_param_gather,
    )
    optimizer = get_megatron_optimizer(config, model_chunks)
    decay_style = {"constant": "constant", "linear": "linear", "cosine": "cosine"}[t.lr_schedule]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if t.warmup_steps else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps, lr_decay_steps=t.steps, lr_decay_style=decay_style,
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
        # The recipe is the source of truth: on resume, its lr/schedule win over the checkpoint's
        # (only the step count comes from the checkpoint).
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )
    return optimizer, scheduler


def wrap_ddp(recipe: Recipe, model):
    """DDP around the model; for bf16, Megatron's `Float16Module` first, so that every parameter
    (the norms too, which the local spec creates in fp32) is bf16 and outputs come back in fp32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    t = recipe.train
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=t.distributed_optimizer, average_in_collective=False,
        overlap_grad_reduce=t.overlap_grad_reduce, overlap_param_gather=t.overlap_param_gather,
        bucket_size=t.ddp_bucket_size,
    )
    if model.config.bf16:
        model = Float16Module(model.config, model)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def report_divergence(step: int, what: str, root: Path, samples: range) -> int:
    """Say on stderr (rank 0) that step `step` diverged (`what`: the numbers that show it, the same on every
    rank) and where to go on from; returns `EXIT_DIVERGED`."""
    from megatron_ext.checkpoint_layout import latest_iteration

    last = latest_iteration(root)
    go_on = (f"the newest checkpoint, {root}/iter_{last:07d}, is from before: resume from it" if last is not None
             else "no checkpoint yet: start again")
    if torch.distributed.get_rank() == 0:
        print(f"error: step {step}: {what}: training diverged; stopped without saving; {go_on} with a lower "
              f"train.lr or more train.warmup_steps, or look at this step's samples ({samples.start}.."
              f"{samples.stop - 1} of the run)", file=sys.stderr, flush=True)
    return EXIT_DIVERGED


# ---------------------------------------------------------------------------- main


def train(recipe: Recipe, stop: StopFlag | None = None) -> int:
    """Run the recipe on the already-initialised process group; returns the exit code."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.model import build_model_from_recipe
    from megatron_ext.checkpoint_saver import CheckpointSaver
    from megatron_ext.cost_model import gpu_from_device_name, shape_from_hf_config, train_flops
    from megatron_ext.resume import data_identities
    from megatron_ext.train_profile import StepProfiler
    from megatron_ext.train_start import start_point
    from megatron_ext.training_data import build_batches

    t, p = recipe.train, recipe.parallel
    root = Path(recipe.checkpoint.dir)
    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = t.global_batch_size // (t.micro_batch_size * dp_size)
    hf_cfg = hf_config_from_recipe(recipe)
    rank0 = torch.distributed.get_rank() == 0

    model = build_model_from_recipe(recipe)
    ddp_model = wrap_ddp(recipe, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp_model.no_sync
    optimizer, scheduler = build_optimizer(recipe, [ddp_model])

    # What the data holds, read once (a pass over each PREFIX.idx) and by rank 0 alone, which writes the metadata
    # and the log: a resume from a checkpoint of other contents under the same prefix is warned about.
    data_now = data_identities(recipe) if rank0 else {}
    metadata = {"recipe": recipe.to_dict(), "hf_config": hf_cfg, "tokenizer": recipe.model.tokenizer,
                "data_identity": data_now}
    stop = stop or StopFlag()
    begin = start_point(recipe, model, optimizer, scheduler, metadata, data_now, dp_size)
    if begin.finished:  # a finished run started again (a requeue, a rerun)
        stop.settle()
        log(f"[train] {root} is at step {begin.step} and train.steps = {t.steps}: nothing to train "
            "(raise train.steps to go on)")
        return 0
    start, consumed_samples, tokens_seen = begin.step, begin.consumed_samples, begin.tokens

    data, valid = build_batches(recipe, dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp_size,
                                cp_rank=parallel_state.get_context_parallel_rank(), cp_size=p.context,
                                first_step=start, consumed_samples=consumed_samples, device=rank_device(),
                                min_train_samples=begin.data_samples)
    if passes := data.passes(t.steps):
        log(f"[train] SFT data: {passes}")
    metrics = MetricsLog(root / "metrics.jsonl", start, enabled=rank0,
                         tensorboard_dir=recipe.checkpoint.tensorboard_dir)
    metrics.stop_if_unwritten()  # rank 0 rewrites it on a resume
    saver = CheckpointSaver(root, keep_last=recipe.checkpoint.keep_last, background=recipe.checkpoint.async_save,
                            log=log, optimizer_sharding=recipe.checkpoint.optimizer_sharding)
    shape = shape_from_hf_config(hf_cfg)
    world = torch.distributed.get_world_size()
    # MFU against the GPU's dense bf16 peak, where it is known (cost_model.GPUS) and the run is bf16
    peak = (gpu_from_device_name(torch.cuda.get_device_name()) if recipe.runtime.device == "cuda"
            and t.precision == "bf16" else None)
    forward_backward = get_forward_backward_func()
    planned = (t.steps - start) * t.global_batch_size * t.seq_length
    log(f"[train] {recipe.name}: {t.stage} seq {t.seq_length} TP{p.tensor} PP{p.pipeline} CP{p.context} "
        f"DP{dp_size} ({world} ranks), {num_microbatches} microbatch(es)/step, steps {start + 1}..{t.steps} "
        f"({planned:,} tokens); checkpoints and metrics.jsonl in {root}")
    for warning in setup_warnings(recipe) if torch.distributed.get_rank() == 0 else []:  # they read the data index
        log(f"[train] warning: {warning}")

    # each profiled rank names its own trace, so its line is not rank 0's alone
    profiler = StepProfiler(recipe.profile, torch.distributed.get_rank(),
                            Path(recipe.profile.dir or root / "profile"), recipe.runtime.device,
                            log=lambda msg: log(msg, every_rank=True))
    if recipe.profile.steps is not None and start >= recipe.profile.steps[1]:
        log(f"[train] profile.steps = {list(recipe.profile.steps)} ran before step {start + 1}: nothing traced "
            "(give steps after it)")
    if t.log_interval > 1:
        log(f"[train] a line every {t.log_interval} steps: loss, tokens/s and TFLOP/s over those steps, grad_norm, "
            "lr and memory of the last (metrics.jsonl: every step)")
    step, loop_start = start, time.time()
    window = LogWindow()
    stop.in_loop = True
    try:
        while step < t.steps:
            step_start = time.time()
            with profiler.step(step + 1):
                ddp_model.zero_grad_buffer()
                optimizer.zero_grad()
                # seq_length: the whole sequence; the schedule sizes its pipeline messages by dividing it by CP
                # (and TP under sequence parallelism) itself.
                reports = forward_backward(
                    forward_step_func=forward_step, data_iterator=data.iterator(step, num_microbatches),
                    model=[ddp_model], num_microbatches=num_microbatches, seq_length=t.seq_length,
                    micro_batch_size=t.micro_batch_size, forward_only=False,
                )
                ok, grad_norm, _ = optimizer.step()
            saver.finalize()  # background saves done on every rank by now go in place
            step_lr = optimizer.param_groups[0]["lr"]  # the rate this step's update used (the scheduler moves on)
            scheduler.step(increment=1)
            step += 1
            loss, n_tokens, packed_pairs = reduce_loss(reports)
            elapsed = time.time() - step_start
            step_tokens = t.global_batch_size * t.seq_length
            # causal attention over each whole sequence, or (SFT) within each packed conversation
            pairs = packed_pairs if t.stage == "sft" else t.global_batch_size * t.seq_length * (t.seq_length + 1) / 2
            tokens_seen += step_tokens
            record = {
                "step": step, "loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "lr": step_lr, "tokens": tokens_seen,
                "loss_tokens": n_tokens, "tokens_per_s": step_tokens / elapsed,
                "tflops_per_device": train_flops(shape, step_tokens, pairs) / elapsed / world / 1e12,
                "memory_gib": memory_gib(), "step_time_s": elapsed, "update_ok": bool(ok),
                "consumed_samples": data.samples_before(step), "time": round(time.time(), 3),
            }
            if peak is not None:
                record["mfu"] = record["tflops_per_device"] / peak.bf16_tflops
            profiler.done(step)
            window.add(record)
            if step % t.log_interval == 0 or step == t.steps:
                mean = window.take()  # this step's numbers at log_interval 1
                mfu = f" MFU {mean['tflops_per_device'] / peak.bf16_tflops:.1%}" if peak is not None else ""
                norm = float("nan") if grad_norm is None else record["grad_norm"]  # 0.0 is a norm, not a NaN
                log(f"[train] step {step}/{t.steps} loss {mean['loss']:.4f} lr {record['lr']:.3g} "
                    f"grad_norm {norm:.3f} tokens/s {mean['tokens_per_s']:.0f} "
                    f"TFLOP/s/dev {mean['tflops_per_device']:.2f}{mfu} mem {record['memory_gib']:.2f} GiB eta "
                    f"{format_duration((time.time() - loop_start) / (step - start) * (t.steps - step))}")
            # The update is already made, so nothing is saved from here on. (Megatron's optimizers compute the
            # gradient norm also with train.clip_grad = 0, so a step that makes weights NaN shows here.)
            if any_rank(not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))):
                metrics.write(record)
                samples = range(data.samples_before(step - 1), data.samples_before(step))
                saver.finalize(blocking=True)  # an earlier step's save is good: in place before the report names it
                stop.settle()
                return report_divergence(step, f"loss {loss}, grad_norm {grad_norm}", root, samples)
            stopping = stop.agreed()
            # not on the way out after a signal: the checkpoint must land before the time limit (this step's
            # validation is skipped; the requeued run starts after it)
            if valid is not None and (step == t.steps or (step % t.eval_interval == 0 and not stopping)):
                eval_start = time.time()
                val_loss, val_tokens = validation_loss(forward_backward, ddp_model, valid, recipe, num_microbatches)
                record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)), val_tokens=val_tokens)
                log(f"[train] step {step}/{t.steps} validation loss {val_loss:.4f} ppl {record['val_ppl']:.4g} "
                    f"({t.eval_iters} batch(es), {val_tokens} tokens, {time.time() - eval_start:.1f} s)")
            metrics.write(record)
            metrics.stop_if_unwritten()  # before the save: where a line found no room, a checkpoint finds none
            interval = recipe.checkpoint.interval
            if stopping or step == t.steps or (interval and step % interval == 0):
                position = {"consumed_samples": data.samples_before(step), "tokens": tokens_seen,
                            "data_samples": data.requested}
                if t.overlap_param_gather:  # the update reaches other ranks' slices of the weights only in the
                    ddp_model.start_param_sync(force_sync=True)  # next forward: gather them before saving
                saver.save(step, [model], optimizer=optimizer, scheduler=scheduler, metadata={**metadata, **position},
                           wait=stopping or step == t.steps)
            if stopping and step < t.steps:
                stop.settle()
            if stopping and step < t.steps and stop.interrupted_anywhere:
                log(f"[train] interrupted (Ctrl-C) after step {step}; checkpoint saved, exiting with "
                    f"{EXIT_INTERRUPTED}: the same command goes on from it")
                return EXIT_INTERRUPTED
            if stopping and step < t.steps:
                # stop.signal is None on a rank the signal did not reach (agreed() heard it from another)
                received = signal.Signals(stop.signal).name if stop.signal else "a stop signal on another rank"
                log(f"[train] received {received}; checkpoint saved, exiting with {EXIT_REQUEUE} to requeue")
                return EXIT_REQUEUE
        took = max(time.time() - loop_start, 1e-6)
        stop.settle()  # complete: a Ctrl-C from here on leaves it so, with exit 0
        log(f"[train] done: steps {start + 1}..{t.steps} in {format_duration(took)}, {planned:,} tokens "
            f"({planned / took:,.0f} tokens/s with validation and saves); checkpoint {root}/iter_{t.steps:07d}, "
            f"metrics {root / 'metrics.jsonl'}")
        return 0
    finally:
        profiler.close()  # a run that stops inside the traced steps writes what it traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    parser.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override given the way tools/plan.py and `recipe check` take them (repeatable; applied "
                        "after the KEY=VALUE ones)")
    args = parser.parse_intermixed_args(argv)
    args.overrides += args.set_overrides
    stop = StopFlag()  # before anything slow: a Slurm warning during start-up still ends in a save
    try:
        code = _run(args, stop)
    except (KeyboardInterrupt, Exception) as e:  # before the loop, or a second Ctrl-C (StopFlag): nothing saved now
        if not isinstance(e, KeyboardInterrupt) and interrupt_behind(e) is None:
            raise  # an error, not a Ctrl-C that an import's class body (Python 3.11) wrapped in a RuntimeError
        stop.settle()
        say_stopped_unsaved(stop.in_loop)
        return EXIT_INTERRUPTED
    stop.settle()  # its line is said (done, an error): Python's exit, torch's teardown, changes the outcome no more
    return code


def _run(args: argparse.Namespace, stop: StopFlag) -> int:
    """`main` once its arguments are read: the recipe, the process group, `train`; user errors as one line."""
    from megatron_ext.runtime import DeviceError, destroy_distributed, init_distributed, process_env
    from megatron_ext.runtime.distributed import is_alike_on_every_rank

    env = process_env()
    if env.local_rank != 0:
        # Library warnings (Megatron's TE/Apex fallbacks, torch's deprecations) are alike on every rank: each node's
        # first rank says them (a node whose libraries differ still shows it); every rank's copy added ~20 lines per
        # start to the job log (5,000 at 256 GPUs, 640 now).
        warnings.simplefilter("ignore")
    try:
        recipe = load_recipe(args.recipe, args.overrides, world_size=env.world_size)
        check_setup(recipe)
    except RecipeError as e:
        # from the recipe and the files it names, alike on every rank of a node: said by each node's first rank, not
        # once per GPU (a node that alone cannot see a file still says so)
        if env.local_rank == 0:
            from megatron_ext.recipe_rules import WorldSizeError

            alone = isinstance(e, WorldSizeError) and env.launcher == "single"
            print(f"error: {e.started_alone() if alone else e}", file=sys.stderr)
        return 1
    p = recipe.parallel
    try:
        init_distributed(recipe.runtime.device, tensor=p.tensor, pipeline=p.pipeline, context=p.context,
                         hierarchical_context_sizes=p.hierarchical_context_sizes, seed=recipe.train.seed,
                         timeout_minutes=recipe.runtime.timeout_minutes)
    except DeviceError as e:  # may be one task's alone (its CUDA_VISIBLE_DEVICES): every rank says its own
        print(f"error: rank {env.rank}: {e}" if env.world_size > 1 else f"error: {e}", file=sys.stderr)
        return 1
    try:
        from megatron_ext.checkpoint import CheckpointError
        from megatron_ext.data import DataError

        return train(recipe, stop)
    except (RecipeError, CheckpointError, DataError) as e:  # user mistakes found at setup
        if not is_alike_on_every_rank(e):  # perhaps this rank's alone: each says its own
            print(f"error: rank {env.rank}: {e}" if env.world_size > 1 else f"error: {e}", file=sys.stderr)
        elif env.rank == 0:  # rank 0 found it for all (rank_zero_outcome): said once, not once per rank
            print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        what = out_of_memory(e)
        if what is None:
            raise
        env = process_env()
        advice = out_of_memory_advice(recipe, args.recipe, args.overrides, env.world_size)
        print(f"error: rank {env.rank}: out of memory ({what}): {advice}", file=sys.stderr, flush=True)
        return 1
    except MemoryError as e:  # the host's (numpy's sample index among others), which no RuntimeError covers
        t = recipe.train
        print(f"error: rank {process_env().rank}: out of host memory ({type(e).__name__}: {e}); the data index holds "
              f"train.steps x train.global_batch_size = {t.steps:,} x {t.global_batch_size:,} samples: check "
              "train.steps, and the memory the job may use", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.settle()  # the outcome is said above, or is the interrupt's (main): the teardown changes neither
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
