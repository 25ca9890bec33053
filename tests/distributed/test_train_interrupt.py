"""Ctrl-C in the trainer: in the loop the step ends, a checkpoint is saved and the run exits 130, one line, and the
same command goes on from it; before the loop (the imports too) it stops at once, in one line; after `done` it
changes nothing. (Before: a KeyboardInterrupt traceback from every rank and nothing saved since the last interval.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


def start(tmp_path, token_data, steps: int, warnings: str = "ignore", held: str | None = None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS=warnings)
    program = ["-c", HELD, held] if held else ["-m", "megatron_ext.train"]
    return subprocess.Popen([sys.executable, *program, "--recipe", "recipes/tiny/cpt.yaml",
                             f"data.prefix={token_data}", "parallel.context=1", f"train.steps={steps}",
                             "checkpoint.interval=0", f"checkpoint.dir={tmp_path / 'run'}"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def steps_written(tmp_path) -> list[int]:
    path = tmp_path / "run/metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def test_ctrl_c_in_the_loop_saves_and_exits_130(tmp_path, token_data):
    proc = start(tmp_path, token_data, steps=2000)
    deadline = time.time() + 240
    while len(steps_written(tmp_path)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # as torchrun passes the terminal's on: within the same second, not a second one
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err + out, err[-3000:]
    last = steps_written(tmp_path)[-1]
    assert (tmp_path / "run/latest_checkpointed_iteration.txt").read_text().strip() == str(last) and last < 2000
    assert f"interrupted (Ctrl-C) after step {last}; checkpoint saved, exiting with 130" in out + err
    assert "Ctrl-C: finishing this step and saving" in out + err


# `python -m megatron_ext.train` (through runpy) that stops at one point, says `held: POINT` on stderr and goes on
# when a line comes on stdin; a signal lands there wherever the machine delivers it. The points: `imports` (torch's,
# at the top of megatron_ext.train), `process group` (init_distributed, after the recipe is read), `model` (its
# build), `end` (destroy_distributed, after `done`). Waiting for one of Megatron-Core's warnings instead left 0.9 s
# before the first step: a Ctrl-C that a loaded machine delivered later landed in the loop.
HELD = """
import runpy, sys

point = sys.argv.pop(1)

def hold():
    print(f"held: {point}", file=sys.stderr, flush=True)
    sys.stdin.readline()

if point == "imports":
    class HoldTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                hold()

    sys.meta_path.insert(0, HoldTorch())
elif point == "model":
    from megatron_ext import model

    model.build_model_from_recipe = lambda *args, **kwargs: hold()
else:
    from megatron_ext.runtime import distributed

    name = {"process group": "init_distributed", "end": "destroy_distributed"}[point]
    real = getattr(distributed, name)

    def held(*args, **kwargs):
        hold()
        return real(*args, **kwargs)

    setattr(distributed, name, held)
runpy.run_module("megatron_ext.train", run_name="__main__", alter_sys=True)
"""


def wait_until_held(proc, point: str) -> list[str]:
    seen = []
    while not seen or seen[-1] != f"held: {point}\n":
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)
    return seen


@pytest.mark.parametrize("point", ["imports", "process group", "model"])
def test_ctrl_c_before_the_loop_stops_at_once_in_one_line(tmp_path, token_data, point):
    """Ctrl-C while torch was imported was a traceback (the handler not yet installed), in the process group's start
    exit 130 without a word; now each, and one while the model is built, is one line, exit 130, nothing saved."""
    proc = start(tmp_path, token_data, steps=5, held=point)
    seen = wait_until_held(proc, point)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen[:-1]) + err
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "[train] interrupted (Ctrl-C) before the first step: nothing trained or saved; the same command starts again "
        "(from the newest checkpoint in checkpoint.dir, if there is one)"), err[-3000:]
    assert steps_written(tmp_path) == [] and not (tmp_path / "run/latest_checkpointed_iteration.txt").exists()


def test_ctrl_c_after_done_changes_nothing(tmp_path, token_data):
    """A Ctrl-C after the run's `done` line printed 'Ctrl-C: finishing this step and saving' after it (the handler
    still armed), or, in Python's exit, ended the complete run with status -2 and no word. The run is complete: it
    now exits 0 and says nothing more."""
    proc = start(tmp_path, token_data, steps=1, held="end")
    seen = wait_until_held(proc, "end")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, "".join(seen) + err
    assert out.splitlines()[-1].split("] ", 1)[1].startswith("[train] done: steps 1..1"), out
    assert "Ctrl-C" not in out + err and "Traceback" not in err, out + err
    assert (tmp_path / "run/latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_sigterm_while_importing_saves_after_the_first_step(tmp_path, token_data):
    """SIGTERM (scancel, Slurm's stop) while torch was imported killed the run with no word and no requeue (its
    default action; the trainer's handler came later); now the run handles it as one during the setup: the first
    step, a save, the requeue exit 3."""
    proc = start(tmp_path, token_data, steps=5, held="imports")
    wait_until_held(proc, "imports")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 3, err[-3000:]
    assert "received SIGTERM; checkpoint saved, exiting with 3 to requeue" in out, out + err[-3000:]
    assert steps_written(tmp_path) == [1]
    assert (tmp_path / "run/latest_checkpointed_iteration.txt").read_text().strip() == "1"
