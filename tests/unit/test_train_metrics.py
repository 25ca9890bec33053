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
