"""The training loop's reports: durations in the progress line."""

import pytest

from megatron_ext.train_metrics import format_duration


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (-3, "0s"), (59.4, "59s"), (59.6, "1m00s"), (61, "1m01s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (3725, "1h02m"), (90000, "25h00m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
