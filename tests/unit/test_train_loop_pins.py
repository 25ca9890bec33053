"""Pins of megatron_ext.train's loop from the mutation audit (round 8), run in this process on one gloo rank
(`train(recipe, stop)`, a tiny CPT recipe at seq_length 256, a fraction of a second a run): what a resumed run says
and records about its own steps, the log lines of a log_interval, how a stop signal and a Ctrl-C end the loop.

The distributed tests start the trainer as processes (seconds each); these reach the same loop where a single
rank shows the behaviour. StopFlag installs signal handlers and its settle ignores them: the test process's own
are put back after each test."""

from __future__ import annotations

import json
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
