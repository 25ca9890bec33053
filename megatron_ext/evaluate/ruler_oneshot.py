"""The wording of the vt and cwe prompts and their one solved example, as NVIDIA/RULER puts before the question.

RULER's variable tracking and common words extraction prompts start with one example of the task, solved: the
task's instruction, a small body, the question, the answer prefix and the right answer, then the real task
(`scripts/data/synthetic/variable_tracking.py`, `common_words_extraction.py`). Sizes are RULER's:

- vt: one chain of 4 hops (5 names) in a noise paragraph repeated as often as fits the example's question part in
  500 tokens; answered by the names in chain order, space-separated.
- cwe: 40 words, 10 of them 10 times and 30 of them 3 times (lengths of at least 4096 tokens); 20 words, 10 of them
  3 times and 10 once below 4096; answered "1. word 2. word ... 10. word".

Unlike RULER, whose example names are shorter than the real ones (3 letters against 5) and whose example words are
drawn independently of the real list's, the example's names and words here are fresh draws from the prompt's own
word set (`new_words` takes from it), so none is one of the real prompt's; its vt value differs from the real one.
The builders in `ruler_tasks` draw the example from the sample's own RNG, so a prompt stays one per seed. Both
examples are plain text at the start of the user turn, as RULER's vt example is (RULER formats its cwe example with
the whole model template, so a chat prompt holds the chat markers twice).
"""

from __future__ import annotations

import random
from typing import Callable

VT_EXAMPLE_TOKENS = 500                 # RULER fits its vt example's prompt (answer left out) in 500 tokens
CWE_EXAMPLE_SIZES = {True: (40, 10, 3), False: (20, 3, 1)}  # length >= 4096: (words, common count, rare count)
CWE_EXAMPLE_LONG = 4096                 # RULER's cut between its two cwe example sizes
SEPARATOR = "\n\n"                      # between the solved example and the real task


def vt_wording(value: str) -> tuple[str, str, str]:
    """(instruction, question, answer prefix) of a vt prompt whose chain starts at `value`."""
    return ("Variable assignments are hidden in the text below. Remember them; you will be asked about them.\n\n"
            "Text:",
            f"\n\nWhich variables hold the value {value}, assigned directly or through other variables? Name all "
            "of them.",
            f" The variables that hold {value} are:")


def cwe_wording(top: str) -> tuple[str, str, str]:
    """(instruction, question, answer prefix) of a cwe prompt asking for the `top` (a number word) most common."""
    return ("Below is a numbered list of words. A few words appear far more often than the others.\n\nList:",
            f"\n\nWhat are the {top} most common words in the list above?",
            f" The {top} most common words in the list are:")


def _solved(parts: tuple[str, str, str], body: str, answer: str) -> str:
    instruction, question, prefix = parts
    return instruction + body + question + prefix + answer + SEPARATOR


def vt_example(rng: random.Random, new_names: Callable[[int], list[str]], real_value: str, hops: int, noise: str,
               n_tokens: Callable[[str], int]) -> str:
    """The solved vt example (text, separator included): a chain of `hops` hops from a 5-digit value other than
    `real_value`, names from `new_names(n)`, in `noise` repeated as often as keeps its prompt part within
    VT_EXAMPLE_TOKENS tokens (`n_tokens` counts them), the lines at random places in chain order."""
    names = new_names(hops + 1)
    value = real_value
    while value == real_value:
        value = str(rng.randrange(10_000, 100_000))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    parts = vt_wording(value)

    def prompt(k: int) -> str:  # its size: the lines' place changes the count by a token at most
        return parts[0] + " " + " ".join([noise] * k + lines) + parts[1] + parts[2]

    fixed = n_tokens(prompt(0))
    k = max(0, (VT_EXAMPLE_TOKENS - fixed) // max(1, n_tokens(" " + noise)))
    while k > 0 and n_tokens(prompt(k)) > VT_EXAMPLE_TOKENS:
        k -= 1
    items: list[str] = [noise] * k
    for at, line in zip(sorted(rng.sample(range(k + len(lines)), len(lines))), lines):  # in order, anywhere
        items.insert(at, line)
    return _solved(parts, " " + " ".join(items), " " + " ".join(names))  # "Text: " as the real task's body


def cwe_example(rng: random.Random, new_words: Callable[[int], list[str]], length: int, common: int,
                top: str) -> str:
    """The solved cwe example (text, separator included) for a prompt of `length` tokens: RULER's word counts for
    that length, `common` words asked for (`top`: that number as a word), words from `new_words(n)`."""
    n_words, common_count, rare_count = CWE_EXAMPLE_SIZES[length >= CWE_EXAMPLE_LONG]
    words = new_words(n_words)
    listed = words[:common] * common_count + words[common:] * rare_count
    rng.shuffle(listed)
    return _solved(cwe_wording(top), _numbered(listed), _numbered(words[:common]))


def _numbered(words: list[str]) -> str:
    return "".join(f" {i}. {w}" for i, w in enumerate(words, 1))
