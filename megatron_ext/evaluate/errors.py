"""The one error type of the evaluation package: a user mistake with a message that says the fix."""

from __future__ import annotations


class EvalError(ValueError):
    """Bad evaluation input (paths, lengths, depths, haystack); `tools/niah.py` prints it as one line."""
