"""The trainer's progress lines (train_metrics.log) start with the local wall-clock time, then the message as it was
given, so a job log reads against Slurm's and the nodes' events and `grep "[train]"` still finds the lines."""

from __future__ import annotations

from datetime import datetime

from megatron_ext.log_lines import LOG_TIME_FORMAT
from megatron_ext.train_metrics import LogWindow, log

MESSAGE = "[train] step 3/10 loss 2.5000 lr 0.0001 eta 5s"


def split_line(line: str) -> tuple[datetime, str]:
    """(the time, the message) of a logged line; fails when it does not start with a time."""
    assert line.startswith("["), line
    stamp, msg = line[1:].split("] ", 1)
    return datetime.strptime(stamp, LOG_TIME_FORMAT), msg


def test_a_logged_line_starts_with_a_parseable_time_and_keeps_the_message(capsys):
    log(MESSAGE)
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1, out
    stamp, msg = split_line(out.rstrip("\n"))
    assert msg == MESSAGE
    # the documented form, exactly: `[YYYY-MM-DD HH:MM:SS] ` (19 characters between the brackets)
    assert out[0] == "[" and out[20:22] == "] " and len(stamp.strftime(LOG_TIME_FORMAT)) == 19
    assert stamp.tzinfo is None  # local time, as `date` prints it, not a UTC offset


def test_the_time_format_is_megatron_lms():
    assert datetime(2026, 12, 2, 14, 5, 9).strftime(LOG_TIME_FORMAT) == "2026-12-02 14:05:09"


def test_rank_0_alone_prints_unless_every_rank(capsys, monkeypatch):
    """On rank 1 of a group a plain line is not printed; a profiler's line (`every_rank`) is, with its time."""
    import torch

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    log("[train] step 3/10")
    assert capsys.readouterr().out == ""
    log("[train] profile: steps 2..3 on rank 1: trace", every_rank=True)
    _, msg = split_line(capsys.readouterr().out.rstrip("\n"))
    assert msg == "[train] profile: steps 2..3 on rank 1: trace"


def test_a_line_over_several_steps_gives_their_token_mean_loss_and_rates():
    """train.log_interval > 1: the line's loss is the token mean over the steps since the last line (not the last
    step's), tokens/s and TFLOP/s are over their summed step time; the window then starts again."""
    window = LogWindow()
    window.add({"loss": 2.0, "loss_tokens": 100, "tokens_per_s": 1000.0, "tflops_per_device": 10.0,
                "step_time_s": 1.0})
    window.add({"loss": 4.0, "loss_tokens": 300, "tokens_per_s": 500.0, "tflops_per_device": 4.0,
                "step_time_s": 3.0})
    assert window.take() == {"loss": 3.5, "tokens_per_s": 625.0, "tflops_per_device": 5.5}
    window.add({"loss": 1.0, "loss_tokens": 10, "tokens_per_s": 10.0, "tflops_per_device": 1.0, "step_time_s": 2.0})
    assert window.take() == {"loss": 1.0, "tokens_per_s": 10.0, "tflops_per_device": 1.0}  # only the new step
