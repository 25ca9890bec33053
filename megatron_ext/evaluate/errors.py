"""The one error type of the evaluation package: a user mistake with a message that says the fix."""

from __future__ import annotations


class EvalError(ValueError):
    """Bad evaluation input (paths, lengths, depths, haystack); `tools/niah.py` prints it as one line."""


class RankError(EvalError):
    """An error one rank of a multi-process evaluation meets alone (out of memory on its GPU): every rank that
    meets it reports it, with its rank, where errors every rank finds alike are reported by rank 0 only."""
