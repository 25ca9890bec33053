"""Pins of megatron_ext.train's loop from the mutation audit (round 8), run in this process on one gloo rank
(`train(recipe, stop)`, a tiny CPT recipe at seq_length 256, a fraction of a second a run): what a resumed run says
and records about its own steps, the log lines of a log_interval, how a stop signal and a Ctrl-C end the loop.

The distributed tests start the trainer as processes (seconds each); these reach the same loop where a single
rank shows the behaviour. StopFlag installs signal handlers and its settle ignores them: the test process's own
are put back after each test."""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest

from megatron_ext.checkpoint_layout import latest_iteration, read_metadata
from megatron_ext.recipe import load_recipe
from megatron_ext.train_stop import EXIT_INTERRUPTED, StopFlag
from tests.conftest import ROOT

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
SEQ = 256  # tokens per sample; global batch 1: one sample, 256 tokens a step


@pytest.fixture
def handlers() -> Iterator[None]:
    """The test process's signal handlers, put back after the test."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _run(root: Path, data: str, *overrides: str, stop: StopFlag | None = None) -> int:
    """The trainer's loop on this process's one rank, for the tiny CPT recipe (one sample of 256 tokens a step)."""
    from megatron_ext.train import train

    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", [f"checkpoint.dir={root}", f"data.prefix={data}",
                         "parallel.context=1", f"train.seq_length={SEQ}", "train.global_batch_size=1", *overrides],
                         world_size=1)
    return train(recipe, stop)


def _lines(out: str) -> list[str]:
    """The trainer's lines without their local time."""
    return [re.sub(r"^\[[^]]*\] ", "", line) for line in out.splitlines() if "[train] " in line]


def _metrics(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_says_and_records_its_own_steps(tmp_path, token_data, cpu_parallel_state, handlers, capsys):
    """Steps 1..3 at log_interval 2, then resumed to step 4 at log_interval 1 with profile.steps [2, 3]:
    - the first run logs steps 2 and 3 (the last step is logged off the interval) and says what a line covers;
    - its checkpoint and metrics.jsonl hold the samples consumed after each step (1, 2, 3) and the tokens seen;
    - the resumed run's header and closing line name its own steps 4..4 and 256 tokens, not the run's 1,024;
      it does not explain log_interval 1, says the profiled steps ran before it, and counts tokens on (1,024).
    Controls: TR7 (last step unlogged), TR6 (interval line at 1), TR15/TR13 (samples of the step before), TR27
    (tokens not counted), TR18 (planned tokens of the whole run), TR19 (header from step 3), TR5 (profile
    boundary: start == last profiled step said nothing)."""
    root = tmp_path / "run"
    assert _run(root, token_data, "train.steps=3", "train.log_interval=2") == 0
    first = _lines(capsys.readouterr().out)
    assert [line.split(" loss ")[0] for line in first if line.startswith("[train] step ")] == [
        "[train] step 2/3", "[train] step 3/3"]
    assert sum(line.startswith("[train] a line every 2 steps: ") for line in first) == 1
    assert [(m["consumed_samples"], m["tokens"]) for m in _metrics(root)] == [(1, SEQ), (2, 2 * SEQ), (3, 3 * SEQ)]
    saved = read_metadata(root)
    assert (saved["consumed_samples"], saved["tokens"]) == (3, 3 * SEQ)

    assert _run(root, token_data, "train.steps=4", "profile.steps=[2,3]") == 0
    second = _lines(capsys.readouterr().out)
    header = [line for line in second if line.startswith("[train] cpt: ")]
    assert len(header) == 1 and ", steps 4..4 (256 tokens); " in header[0], second
    assert not any(line.startswith("[train] a line every") for line in second), second
    assert "[train] profile.steps = [2, 3] ran before step 4: nothing traced (give steps after it)" in second
    assert second[-1].startswith("[train] done: steps 4..4 in ") and ", 256 tokens (" in second[-1], second[-1]
    assert _metrics(root)[-1]["tokens"] == 4 * SEQ and latest_iteration(root) == 4


def test_a_stop_signal_saves_and_exits_for_requeue_a_ctrl_c_exits_130(tmp_path, token_data, cpu_parallel_state,
                                                                      handlers, capsys):
    """A SIGUSR1 (Slurm's warning) that came before step 1 ended: step 1 is saved, the line names SIGUSR1 and the
    exit is 3 (requeue). A Ctrl-C in the loop: the step is saved and the exit is 130, no requeue. Controls: TR17
    (the signal named 'on another rank'), TR16 (Ctrl-C and requeue swapped)."""
    from megatron_ext.train import EXIT_REQUEUE

    root = tmp_path / "run"
    stop = StopFlag()
    stop.signal = signal.SIGUSR1
    assert _run(root, token_data, "train.steps=4", stop=stop) == EXIT_REQUEUE
    assert _lines(capsys.readouterr().out)[-1] == (
        f"[train] received SIGUSR1; checkpoint saved, exiting with {EXIT_REQUEUE} to requeue")
    assert latest_iteration(root) == 1

    stop = StopFlag()
    stop.in_loop = True
    stop._handle(signal.SIGINT, None)  # what Python calls on a Ctrl-C in the loop
    assert _run(root, token_data, "train.steps=4", stop=stop) == EXIT_INTERRUPTED
    assert _lines(capsys.readouterr().out)[-1].startswith(
        f"[train] interrupted (Ctrl-C) after step 2; checkpoint saved, exiting with {EXIT_INTERRUPTED}")
    assert latest_iteration(root) == 2


def test_a_set_override_comes_after_the_plain_ones(tmp_path, handlers, capsys):
    """`--set KEY=VALUE` (plan.py's form) is applied after the plain KEY=VALUE overrides, as --help says: given
    both for train.steps, the --set value (0) is the one refused, before any process group or data is touched.
    Control: TR20 (--set applied first: steps 2 wins, and the run goes on to the missing data instead)."""
    from megatron_ext.train import main

    code = main(["--recipe", str(ROOT / "recipes/tiny/cpt.yaml"), f"checkpoint.dir={tmp_path}",
                 f"data.prefix={tmp_path / 'no_data'}", "train.steps=2", "--set", "train.steps=0"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: train.steps = 0: "), err


def test_a_divergence_after_iteration_0_names_it(tmp_path, cpu_parallel_state, capsys):
    """A run that resumed from iteration 0 (a converted checkpoint's number) and diverged at step 1 is told to
    resume from iter_0000000, not that there is no checkpoint yet. Control: TR21 (iteration 0 read as none)."""
    from megatron_ext.train import EXIT_DIVERGED, report_divergence

    (tmp_path / "iter_0000000").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0\n")
    assert report_divergence(1, "loss nan, grad_norm nan", tmp_path, range(0, 1)) == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert f"the newest checkpoint, {tmp_path}/iter_0000000, is from before: resume from it with a lower " in err, err
    assert err.endswith("look at this step's samples (0..0 of the run)\n"), err


# ---------------------------------------------------------------------------- round 8, second pass (TR33 and up)


def test_the_lr_schedule_and_the_per_step_rates_a_run_records(tmp_path, token_data, cpu_parallel_state, handlers,
                                                              capsys):
    """A linear schedule (lr 1e-3 to min_lr 1e-4, one warmup step, 4 steps) at log_interval 2:
    - metrics.jsonl holds the rate each step's update used: 0 (warmup from 0), 1e-3, then the decay over the 3
      steps after warmup down towards min_lr (7e-4, 4e-4), and the log line of step 4 names step 4's rate;
    - tokens_per_s and tflops_per_device are this step's tokens and causal-attention FLOPs over this step's time;
    - a log line's loss is the mean over its steps; the last line's eta is 0s; the header counts the microbatches
      of a step (global batch 2 in one microbatch of 2: one).
    A resume with lr 2e-3 constant runs step 5 at 2e-3: the recipe's schedule wins over the checkpoint's.
    Controls: TR33 (warmup from lr), TR34 (decay over steps + 1), TR35 (linear read as cosine), TR36 (the rate
    after the scheduler moved on), TR37 (min_lr 0), TR62 (the line names train.lr), TR38 (the checkpoint's
    schedule on resume), TR58/TR59/TR64 (the per-step rates), TR56 (a line's loss the last step's), TR57 (eta of
    one step more), TR65 (microbatches not divided by the micro batch)."""
    from megatron_ext.cost_model import shape_from_hf_config, train_flops
    from megatron_ext.hf_config import hf_config_from_recipe

    root = tmp_path / "run"
    assert _run(root, token_data, "train.steps=4", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=1",
                "train.lr_schedule=linear", "train.log_interval=2", "train.global_batch_size=2",
                "train.micro_batch_size=2") == 0
    lines = _lines(capsys.readouterr().out)
    records = _metrics(root)
    assert [m["lr"] for m in records] == pytest.approx([0.0, 1e-3, 7e-4, 4e-4], abs=1e-12)
    header = [line for line in lines if line.startswith("[train] cpt: ")]
    assert len(header) == 1 and ", 1 microbatch(es)/step, " in header[0], header
    steps = [line for line in lines if line.startswith("[train] step ")]
    assert [line.split(" loss ")[0] for line in steps] == ["[train] step 2/4", "[train] step 4/4"], lines
    mean_loss = (records[2]["loss"] + records[3]["loss"]) / 2
    assert f" loss {mean_loss:.4f} lr 0.0004 " in steps[1] and steps[1].endswith(" eta 0s"), steps[1]

    step_tokens = 2 * SEQ
    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["parallel.context=1", f"train.seq_length={SEQ}"],
                         world_size=1)
    flops = train_flops(shape_from_hf_config(hf_config_from_recipe(recipe)), step_tokens,
                        step_tokens * (SEQ + 1) / 2)
    for m in records:
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(step_tokens, rel=1e-6), m
        assert m["tflops_per_device"] * m["step_time_s"] * 1e12 == pytest.approx(flops, rel=1e-6), m

    assert _run(root, token_data, "train.steps=5", "train.lr=2e-3", "train.global_batch_size=2",
                "train.micro_batch_size=2") == 0
    assert _metrics(root)[-1]["lr"] == pytest.approx(2e-3, abs=1e-12)


def test_a_diverged_step_is_recorded_and_named_after_the_saved_one(tmp_path, token_data, cpu_parallel_state,
                                                                   handlers, capsys):
    """A run whose weights blow up (lr 1e30) after step 1, saved in the background at every step: step 2's gradient
    norm is not finite, so the run exits 4 unsaved, metrics.jsonl holds step 2 (what showed it), and the one line names
    step 2's sample (1..1 of the run) and the background save of step 1 as the newest checkpoint, in place by then.
    Its setup warning (rope.partial_rotary_factor: no Hugging Face export) is in the log of a one-rank run.
    Controls: TR55 (the setup warnings said by the other ranks only), TR43 (step 2 not in metrics.jsonl), TR44/TR63
    (another step's samples), TR45 (step 1's save not waited for: 'no checkpoint yet'), TR49 (no save at interval 1)."""
    from megatron_ext.train import EXIT_DIVERGED

    root = tmp_path / "run"
    assert _run(root, token_data, "train.steps=3", "train.lr=1e30", "checkpoint.interval=1",
                "checkpoint.async_save=true", "rope.partial_rotary_factor=0.5") == EXIT_DIVERGED
    out, err = capsys.readouterr()
    assert sum(line.startswith("[train] warning: rope.partial_rotary_factor = 0.5: ") for line in _lines(out)) == 1
    last = _metrics(root)[-1]
    assert (last["step"], last["non_finite"]) == (2, {"grad_norm": "nan"}), last
    assert latest_iteration(root) == 1
    assert err.startswith(f"error: step 2: loss {last['loss']}, grad_norm nan: training diverged; ") and (
        f"the newest checkpoint, {root}/iter_0000001, is from before: resume from it" in err), err
    assert err.endswith("look at this step's samples (1..1 of the run)\n"), err


def test_validation_saves_and_a_stop_at_the_last_step(tmp_path, token_data, cpu_parallel_state, handlers, capsys):
    """With a validation split, eval_interval 2, eval_iters 2 and checkpoint.interval 2, saved in the background:
    - 3 steps validate at steps 2 and 3 (the last, off the interval), with ppl = exp(loss) and the line naming its
      2 batches; iter 2 and iter 3 are saved and the last is in place when train returns;
    - run again as it is: 'nothing to train', exit 0;
    - resumed to 5 steps at eval_interval 1 with a SIGUSR1 before step 4 ends: step 4 is saved unvalidated (the
      checkpoint before the time limit), exit 3;
    - resumed with a SIGUSR1 before the last step (5) ends: the run is complete, exit 0 with its done line;
    - a profile of steps 6..8 on a run that stops (SIGUSR1) after step 6 writes the trace of step 6;
    - a Ctrl-C before the last step (7) ends: complete too, exit 0 with its done line.
    Controls: TR46 (the last step unvalidated), TR48 (ppl capped), TR66 (batches named by microbatches), TR49
    (saves off the interval), TR50 (the last background save not waited for), TR53/TR54 (the finished rerun), TR47
    (validation on the way out), TR52/TR51 (a stop at the last step exits 3 / a Ctrl-C there 130), TR61 (a stopped
    run's trace unwritten)."""
    from megatron_ext.train import EXIT_REQUEUE

    root = tmp_path / "run"
    common = ("data.split=80,20,0", "train.eval_iters=2", "checkpoint.async_save=true")
    assert _run(root, token_data, "train.steps=3", "train.eval_interval=2", "checkpoint.interval=2", *common) == 0
    lines = _lines(capsys.readouterr().out)
    records = _metrics(root)
    assert [("val_loss" in m) for m in records] == [False, True, True]
    assert records[2]["val_ppl"] == pytest.approx(math.exp(records[2]["val_loss"]), rel=1e-9)
    assert sum(line.startswith("[train] step 3/3 validation loss ") and " (2 batch(es), " in line
               for line in lines) == 1, lines
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert latest_iteration(root) == 3

    assert _run(root, token_data, "train.steps=3", *common) == 0
    assert _lines(capsys.readouterr().out)[-1] == (
        f"[train] {root} is at step 3 and train.steps = 3: nothing to train (raise train.steps to go on)")

    def usr1() -> StopFlag:
        stop = StopFlag()
        stop.signal = signal.SIGUSR1
        return stop

    assert _run(root, token_data, "train.steps=5", "train.eval_interval=1", *common, stop=usr1()) == EXIT_REQUEUE
    assert "val_loss" not in _metrics(root)[-1] and latest_iteration(root) == 4
    capsys.readouterr()
    assert _run(root, token_data, "train.steps=5", *common, stop=usr1()) == 0
    assert _lines(capsys.readouterr().out)[-1].startswith("[train] done: steps 5..5 in ")
    assert latest_iteration(root) == 5

    assert _run(root, token_data, "train.steps=8", "profile.steps=[6,8]", *common, stop=usr1()) == EXIT_REQUEUE
    assert [p.name for p in (root / "profile").glob("*.pt.trace.json.gz")] == ["rank0.steps6-6.pt.trace.json.gz"]

    ctrl_c = StopFlag()
    ctrl_c.in_loop = True
    ctrl_c._handle(signal.SIGINT, None)  # what Python calls on a Ctrl-C in the loop
    assert _run(root, token_data, "train.steps=7", *common, stop=ctrl_c) == 0
    assert _lines(capsys.readouterr().out)[-1].startswith("[train] done: steps 7..7 in ")
