"""argparse types shared by the command-line tools: a mistake is argparse's one-line usage error, naming the flag."""

from __future__ import annotations

import argparse
from typing import Callable


def whole_number(minimum: int, meaning: str = "") -> Callable[[str], int]:
    """An argparse `type`: an integer >= `minimum` (0 was dropped unseen, -1 printed as iter_-000001); `meaning`
    says what the value is in the message (e.g. "an iteration is a step number")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: {meaning + ' ' if meaning else 'must be '}>= {minimum}")
        return value

    return parse
