"""The training loop's reports: durations in the progress line."""

import pytest

from megatron_ext.train_metrics import format_duration


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (-3, "0s"), (59.4, "59s"), (59.6, "1m00s"), (61, "1m01s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (3725, "1h02m"), (90000, "25h00m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_metrics_log_drops_a_partial_line_on_resume(tmp_path, capsys):
    """A run killed while writing (kill -9, full disk) leaves a partial last line; it made every resume stop with
    a JSONDecodeError. The lines up to the resumed step stay, the rest (the partial one too) is dropped."""
    import json

    from megatron_ext.train_metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 7.0}\n{"step": 2, "loss": 6.5}\n{"step": 3, "loss": 6.0')
    log = MetricsLog(path, start_step=2, enabled=True)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "warning:" in out and "dropped 1 unreadable line(s) (line 3" in out
    log.write({"step": 3, "loss": 6.0})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    MetricsLog(path, start_step=3, enabled=True)  # an intact log: no warning
    assert capsys.readouterr().out == ""


def _tensorboard_scalars(folder, purge=True):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), purge_orphaned_data=purge).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_metrics_and_a_resume_replaces_the_killed_runs_later_steps(tmp_path):
    """TensorBoard (its own event reader is the oracle) gets every number of metrics.jsonl under train/ and val/;
    a run killed after step 5 and resumed at step 3 shows steps 4 and 5 of the resumed run only."""
    from megatron_ext.train_metrics import MetricsLog

    tb = tmp_path / "tb"
    first = MetricsLog(tmp_path / "metrics.jsonl", 0, enabled=True, tensorboard_dir=str(tb))
    for step in range(1, 6):
        first.write({"step": step, "loss": 10.0 - step, "update_ok": True, **({"val_loss": 0.5} if step == 2 else {})})
    resumed = MetricsLog(tmp_path / "metrics.jsonl", 3, enabled=True, tensorboard_dir=str(tb))
    for step in range(4, 7):
        resumed.write({"step": step, "loss": 100.0 + step, "update_ok": True})
    assert _tensorboard_scalars(tb) == {"train/loss": [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0),
                                                       (6, 106.0)], "val/loss": [(2, 0.5)]}
    # the killed run's steps 4 and 5 are in the files: a reader that keeps everything sees both runs' values
    assert len(_tensorboard_scalars(tb, purge=False)["train/loss"]) == 8
    MetricsLog(tmp_path / "off.jsonl", 0, enabled=False, tensorboard_dir=str(tmp_path / "tb_off"))  # not rank 0
    assert not (tmp_path / "tb_off").exists()


def _under_file_size_limit(limit: int, code: str, *args: str):
    """Run `code` (argv[1:] = `args`) in a new Python whose writes past `limit` bytes fail with EFBIG, as a full disk
    (ENOSPC) or a quota (EDQUOT) fails them: no root needed."""
    import os
    import resource
    import subprocess
    import sys

    from tests.conftest import ROOT

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=limited)


def test_a_metrics_line_without_room_stops_the_run_and_leaves_whole_lines(tmp_path):
    """Rank 0's append to metrics.jsonl that finds no room (a file-size limit here) raised OSError on rank 0 alone
    (a traceback, the other ranks waiting in the next collective) and left a cut line. Now the line is cut off
    again, the failure kept as one line and raised by `stop_if_unwritten` (which every rank calls); later writes do
    nothing. A resume whose rewrite of the log finds no room leaves it as it was, its copy removed. Control (old
    code): `OSError: [Errno 27] File too large` traceback, a cut last line."""
    import json

    code = """
import sys
from pathlib import Path
from megatron_ext.train_metrics import MetricsLog, MetricsLogError
log = MetricsLog(Path(sys.argv[1]), 0, enabled=True)
for step in range(1, 100):
    log.write({"step": step, "loss": 1.5, "note": "x" * 80})
    try:
        log.stop_if_unwritten()
    except MetricsLogError as e:
        log.write({"step": step + 1, "loss": 1.0})  # nothing more is written
        print(e)
        break
"""
    path = tmp_path / "run" / "metrics.jsonl"
    proc = _under_file_size_limit(1000, code, str(path))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert path.read_text().endswith("\n") and steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert proc.stdout.splitlines() == [
        f"metrics log {path}: file too large (the file system's or the process's file-size limit, ulimit -f); "
        f"training stopped after step {len(steps) + 1}, whose line is not there; there is no checkpoint yet; lift the "
        "file-size limit (ulimit -f) or use a file system that takes larger files"]

    (path.parent / "latest_checkpointed_iteration.txt").write_text("3")
    before = path.read_bytes()
    resume = """
import sys
from pathlib import Path
from megatron_ext.train_metrics import MetricsLog
print(MetricsLog(Path(sys.argv[1]), 3, enabled=True).problem)
"""
    proc = _under_file_size_limit(200, resume, str(path))  # a copy of steps 1..3 is more than 200 bytes
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "file too large" in proc.stdout and "rewriting it to the 3 line(s) up to step 3 failed (it is as it was)" \
        in proc.stdout and "the latest checkpoint is iteration 3, where the same command goes on from" in proc.stdout
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [
        "latest_checkpointed_iteration.txt", "metrics.jsonl"]


def test_tensorboard_without_room_is_one_warning_and_training_goes_on(tmp_path):
    """TensorBoard's writer thread failed to write (here its events file passes a file-size limit): Python printed
    the thread's traceback, and the next add_scalar raised it again on rank 0 alone. Now one warning; the events stop,
    metrics.jsonl (which holds the same numbers) gets every step. Control (old code): 'Exception in thread', a
    traceback and exit 1."""
    import json

    code = """
import sys
from pathlib import Path
from megatron_ext.train_metrics import MetricsLog
log = MetricsLog(Path(sys.argv[1]) / "metrics.jsonl", 0, enabled=True, tensorboard_dir=sys.argv[2])
for step in range(1, 41):
    log.write({"step": step, "loss": 1.5, **{f"m{i}": float(i) for i in range(10)}})
    log.stop_if_unwritten()
"""
    tb = tmp_path / "tb"
    proc = _under_file_size_limit(8000, code, str(tmp_path), str(tb))  # metrics.jsonl: 40 x ~120 bytes, fewer
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    said = proc.stdout.splitlines()
    assert len(said) == 1 and said[0].split("] ", 1)[1].startswith(
        f"[train] warning: checkpoint.tensorboard_dir {tb}: file too large"), said
    assert "no TensorBoard events from step" in said[0] and "(metrics.jsonl has every step)" in said[0]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 41))


@pytest.mark.parametrize("make, said", [
    (lambda p: p.mkdir(), "is a folder, not a file; move it aside or remove it (the trainer writes one JSON line per "
                          "step to that file)"),
    (lambda p: p.write_bytes(b'{"step": 1}\n\xff\xfe\n'), "is not UTF-8 text (byte 0xff at offset 12), so not a log "
                                                          "the trainer wrote; move it aside or remove it"),
    (lambda p: p.symlink_to(p.parent / "gone" / "metrics.jsonl"), "is a symbolic link to {dir}/gone/metrics.jsonl, "
                                                                  "whose folder {dir}/gone does not exist: make that "
                                                                  "folder, or remove the link"),
], ids=["folder", "bytes", "link"])
def test_an_unusable_metrics_log_is_one_line_before_the_first_step(tmp_path, make, said):
    """A folder as metrics.jsonl (IsADirectoryError) and a file of other bytes (UnicodeDecodeError) ended rank 0 in a
    traceback when the log was opened; a link into a folder that does not exist failed only at the first step's line.
    Now each is `problem` at once, raised by `stop_if_unwritten` before any step, and the file is left as it was.
    Control (old code): the two tracebacks, and problem None after the constructor for the link."""
    from megatron_ext.train_metrics import MetricsLog, MetricsLogError

    path = tmp_path / "metrics.jsonl"
    make(path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    log = MetricsLog(path, start_step=0, enabled=True)
    assert log.problem is not None and log.problem.startswith(f"checkpoint.dir = '{tmp_path}': its metrics.jsonl ")
    assert said.format(dir=tmp_path) in log.problem
    with pytest.raises(MetricsLogError, match="its metrics.jsonl"):
        log.stop_if_unwritten()
    log.write({"step": 1, "loss": 1.0})  # nothing written after the problem
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_diverged_steps_infinities_are_null_in_strict_json(tmp_path):
    """A diverged step's loss can be +inf (bf16 overflow) as well as NaN: Python's json writes `Infinity`, which jq
    and JSON.parse refuse, so every non-finite number is null and named in `non_finite`; finite ones stay."""
    import json

    from megatron_ext.train_metrics import MetricsLog

    def strict(word):
        raise ValueError(f"not JSON: {word}")

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, start_step=0, enabled=True)
    log.write({"step": 1, "loss": float("inf"), "grad_norm": float("-inf"), "lr": float("nan"), "tokens": 512})
    log.write({"step": 2, "loss": 6.5, "grad_norm": 1.25, "lr": 1e-4, "tokens": 1024})
    first, second = (json.loads(line, parse_constant=strict) for line in path.read_text().splitlines())
    assert first == {"step": 1, "loss": None, "grad_norm": None, "lr": None, "tokens": 512,
                     "non_finite": {"loss": "inf", "grad_norm": "-inf", "lr": "nan"}}
    assert second == {"step": 2, "loss": 6.5, "grad_norm": 1.25, "lr": 1e-4, "tokens": 1024}
