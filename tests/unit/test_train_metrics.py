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
