"""Pins from mutation audit round 7 of megatron_ext/train_metrics.py: what a resume says about the metrics.jsonl it
finds, a metrics log whose folder cannot be made, and TensorBoard events that outlive a killed process."""

import json

from megatron_ext.train_metrics import MetricsLog


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resume_names_the_steps_it_drops_that_run_again(tmp_path, capsys):
    """A run killed without saving (kill -9) wrote steps 3..5 after its checkpoint of step 2: the resume keeps
    1..2 and says which steps run again, first and last (mutants: no line, or 3..3)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    MetricsLog(path, start_step=2, enabled=True)
    assert _steps(path) == [1, 2]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "warning" not in out, out
    assert (f"[train] {path}: dropped the lines of steps 3..5, written after the checkpoint of step 2: those steps "
            "run again") in out


def test_unreadable_lines_are_listed_up_to_five_and_the_rest_elided(tmp_path, capsys):
    """Five unreadable lines are all named, with no ', ...' (that would say there were more); six: the first
    five and ', ...'."""
    for count, listed in ((5, "line 1, 2, 3, 4, 5;"), (6, "line 1, 2, 3, 4, 5, ...;")):
        path = tmp_path / f"m{count}.jsonl"
        path.write_text("{\n" * count + '{"step": 1}\n')
        MetricsLog(path, start_step=1, enabled=True)
        out = capsys.readouterr().out
        assert f"dropped {count} unreadable line(s) ({listed} a run killed" in out, out
        assert _steps(path) == [1]


def test_blank_lines_are_not_unreadable_and_json_that_is_no_record_is(tmp_path, capsys):
    """A blank line (an editor's, a `echo >>`) is no damage: dropped without a warning (mutant: 'dropped 1
    unreadable line'). A line that is JSON but not an object (`null`, `[1]`, `"x"`) is unreadable, not a
    TypeError traceback that stops every resume."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n   \n{"step": 2}\n')
    MetricsLog(path, start_step=2, enabled=True)
    assert capsys.readouterr().out == ""
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'

    path.write_text('{"step": 1}\nnull\n[1]\n"x"\n{"step": 2}\n')
    MetricsLog(path, start_step=2, enabled=True)
    assert "dropped 3 unreadable line(s) (line 2, 3, 4;" in capsys.readouterr().out
    assert _steps(path) == [1, 2]


def test_a_rank_other_than_0_leaves_the_log_as_it_is(tmp_path, capsys):
    """Only rank 0 (`enabled`) rewrites metrics.jsonl on a resume: another rank that did too (on a shared file
    system) would cut rank 0's file under it and print the drop lines again."""
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)) + '{"step": 4'
    path.write_text(text)
    log = MetricsLog(path, start_step=1, enabled=False)
    assert path.read_text() == text and log.problem is None and capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_checkpoint_dir_that_cannot_be_made_says_training_did_not_start(tmp_path):
    """checkpoint.dir below a file: the folder of metrics.jsonl cannot be made. The one line says the log cannot be
    written and that training did not start (mutant: the mkdir error is overwritten by 'its metrics.jsonl cannot be
    read ...; move it aside or remove it', a file that does not exist)."""
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "run" / "metrics.jsonl"
    log = MetricsLog(path, start_step=0, enabled=True)
    assert log.problem is not None and log.problem.startswith(f"metrics log {path}: cannot be written (")
    assert "training did not start; there is no checkpoint yet" in log.problem
    assert "move it aside" not in log.problem


def test_a_killed_process_keeps_its_events_and_only_tensorboards_thread_is_quieted(tmp_path):
    """(1) Every written step's TensorBoard events are on disk when the process is killed right after (os._exit: no
    atexit, no writer close), as MetricsLog.write promises; TensorBoard's own reader is the oracle (mutant: no flush
    per step; SummaryWriter then holds up to 10 events or 120 s). (2) MetricsLog quiets the OSError of TensorBoard's
    writer thread only: an OSError in any other thread (a background save, a data reader) still prints its
    traceback (mutant: every thread's OSError swallowed, such a failure leaving no trace). One process for both."""
    import os
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import ROOT

    code = """
import os, sys, threading
from pathlib import Path
from megatron_ext.train_metrics import MetricsLog
log = MetricsLog(Path(sys.argv[1]) / "metrics.jsonl", 0, enabled=True, tensorboard_dir=sys.argv[2])
def fail():
    raise OSError("the reader's disk is gone")
t = threading.Thread(target=fail, name="reader")
t.start()
t.join()
sys.stderr.flush()
for step in (1, 2):
    log.write({"step": step, "loss": 5.0 - step})
os._exit(0)  # killed right after the write
"""
    tb = tmp_path / "tb"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tb)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = EventAccumulator(str(tb)).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 4.0), (2, 3.0)]
    assert "Exception in thread reader" in proc.stderr and "OSError: the reader's disk is gone" in proc.stderr


def test_a_failed_rewrite_beside_a_damaged_tracker_is_still_one_line(tmp_path):
    """The resume's rewrite of metrics.jsonl fails (here its copy cannot be made: metrics.jsonl.tmp is a link into
    a missing folder) where latest_checkpointed_iteration.txt holds no number: the one line about the log is still
    said (the tracker's own CheckpointError is for the loader to report), not a CheckpointError traceback from
    within the message (mutant), and the log is as it was."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    (tmp_path / "metrics.jsonl.tmp").symlink_to(tmp_path / "gone" / "x")
    log = MetricsLog(path, start_step=1, enabled=True)
    assert log.problem is not None and log.problem.startswith(f"metrics log {path}: cannot be written (")
    assert "rewriting it to the 1 line(s) up to step 1 failed (it is as it was); training did not start" in log.problem
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_line_whose_step_is_not_a_number_is_unreadable_not_a_traceback(tmp_path, capsys):
    """`{"step": null}` or `{"step": "2"}` (a hand edit, another program's line) ended every resume in a TypeError
    traceback ('<=' not supported between NoneType and int); such a line is unreadable: dropped, with the warning.
    Control (old code): the TypeError."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": null}\n{"step": "2"}\n{"step": 2}\n')
    log = MetricsLog(path, start_step=2, enabled=True)
    assert log.problem is None and _steps(path) == [1, 2]
    assert "dropped 2 unreadable line(s) (line 2, 3;" in capsys.readouterr().out
