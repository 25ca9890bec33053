"""Haystacks: filler text as one token stream with the token indices where sentences start.

A haystack comes from a local text file (e.g. essays, as in the usual NIAH setups) or from a
built-in deterministic generator of plain English sentences. Text is tokenized in blocks that
end at sentence ends, with offsets, so the stream is the tokenizer's own tokenization of the text
and the needle can be put between two sentences, never inside a word.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.io import read_utf8

# End of a sentence: terminal punctuation, optional closing quotes/brackets, then whitespace; or CJK's full stop,
# exclamation and question marks, which no space follows.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|[\u3002\uff01\uff1f][\u300d\u300f\u201d\uff09]*")
_BLOCK_CHARS = 1 << 16  # text per tokenizer call: big enough to be fast, small enough for progress

# Word lists of the built-in filler. Small and digit-free on purpose: the needle's value is the
# only number in the prompt, and a test tokenizer can cover the whole vocabulary.
_ADJ = ["quiet", "old", "green", "small", "bright", "distant", "gentle", "narrow", "warm", "heavy",
        "early", "late", "wide", "calm", "busy", "clear"]
_NOUN = ["river", "garden", "village", "mountain", "farmer", "teacher", "market", "forest", "bridge", "harbor",
         "library", "window", "road", "traveler", "painter", "orchard", "lantern", "valley", "cart", "letter"]
_VERB = ["passes", "follows", "watches", "crosses", "reaches", "remembers", "finds", "leaves", "visits", "greets",
         "carries", "describes"]
_PLACE = ["the hill", "the old mill", "the town square", "the quiet lake", "the long road", "the stone wall",
          "the morning fog", "the evening rain", "the wooden gate", "the open field"]
_TEMPLATES = [
    "The {adj} {noun} {verb} the {noun2} near {place}.",
    "Every day a {adj} {noun} {verb} the {adj2} {noun2}.",
    "In the {adj} season the {noun} {verb} {place}.",
    "Nobody knows why the {noun} {verb} the {noun2} so often.",
    "A {noun} and a {noun2} walk slowly toward {place}.",
    "Later the {adj} {noun2} {verb} the {noun} again.",
]


def filler_words() -> list[str]:
    """Every word and punctuation mark the built-in filler can produce (for building test vocabularies)."""
    text = " ".join(_ADJ + _NOUN + _VERB + _PLACE + _TEMPLATES)
    return sorted(set(re.findall(r"[A-Za-z]+|[^\sA-Za-z{}]", text)))


def filler_sentences(seed: int = 0) -> Iterator[str]:
    """Endless deterministic stream of simple English sentences (same seed, same text, any machine)."""
    rng = random.Random(seed)
    while True:
        t = rng.choice(_TEMPLATES)
        yield t.format(adj=rng.choice(_ADJ), adj2=rng.choice(_ADJ), noun=rng.choice(_NOUN),
                       noun2=rng.choice(_NOUN), verb=rng.choice(_VERB), place=rng.choice(_PLACE))


@dataclass(frozen=True)
class Haystack:
    """A token stream of filler text.

    ids: [N] int64 token ids (no special tokens).
    starts: sorted int64 token indices where a sentence starts, 0 included; a needle goes there.
    """

    ids: np.ndarray
    starts: np.ndarray
    source: str
    digest: str | None = None  # sha256 of a haystack file's text: an edited file is another haystack

    def __len__(self) -> int:
        return len(self.ids)

    def needle_slots(self, n_tokens: int) -> np.ndarray:
        """Sentence starts usable inside a haystack cut to its first `n_tokens` tokens, plus its end. EvalError when
        more than 5% of them (and at least 256) go by without one: a needle would land far from the depth asked
        for (a text without sentence ends put every needle at 0% or 100%, and the heatmap said otherwise)."""
        slots = np.unique(np.append(self.starts[self.starts < n_tokens], n_tokens))
        gaps = np.diff(slots, prepend=0)
        if gaps.max() > max(0.05 * n_tokens, 256):
            at = int(slots[int(np.argmax(gaps))] - gaps.max())
            raise EvalError(f"haystack {self.source}: tokens {at:,} to {at + int(gaps.max()):,} of the {n_tokens:,} "
                            "a prompt takes hold no sentence end, so needles cannot be placed near their depths; "
                            "give a text whose sentences end in . ! ? and a space (or in \u3002 \uff01 \uff1f)")
        return slots


def _split_blocks(text: str) -> Iterator[str]:
    """Cut `text` at sentence ends into blocks of about _BLOCK_CHARS (each next block starts with whitespace)."""
    pos = 0
    while pos < len(text):
        end = pos + _BLOCK_CHARS
        if end >= len(text):
            yield text[pos:]
            return
        m = None
        for m in _SENTENCE_END.finditer(text, pos, end):
            pass
        cut = m.end() if m is not None and m.end() > pos else end
        yield text[pos:cut]
        pos = cut


def tokenize_haystack(tokenizer, blocks: Iterable[str], n_tokens: int, source: str) -> Haystack:
    """Tokenize text blocks (each ending at a sentence end) until at least `n_tokens` tokens.

    Needs a fast tokenizer (offsets). Returns the whole stream read so far; may be shorter than
    `n_tokens` when the blocks run out (the caller says by how much).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise EvalError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; NIAH needs offsets: "
                        "load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    total = 0
    for block in blocks:
        enc = tokenizer(block, add_special_tokens=False, return_offsets_mapping=True)
        block_ids = np.asarray(enc["input_ids"], dtype=np.int64)
        if len(block_ids) == 0:
            continue
        tok_start = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)  # [n] char offsets
        ends = np.asarray([m.end() for m in _SENTENCE_END.finditer(block)], dtype=np.int64)
        # A sentence starts at the first token that begins at or after a sentence end.
        first = np.searchsorted(tok_start, ends, side="left")
        first = first[first < len(block_ids)]
        starts.append(total + np.unique(np.concatenate([[0], first])))
        ids.append(block_ids)
        total += len(block_ids)
        if total >= n_tokens:
            break
    if not ids:
        return Haystack(np.zeros(0, np.int64), np.zeros(1, np.int64), source)
    return Haystack(np.concatenate(ids), np.unique(np.concatenate(starts)), source)


def builtin_haystack(tokenizer, n_tokens: int, seed: int = 0, lead: str = "") -> Haystack:
    """At least `n_tokens` tokens of the built-in deterministic filler. `lead`: text before its first sentence (NIAH
    gives " ": its first sentence then follows a needle put before it as every other sentence does, after a space)."""
    def blocks() -> Iterator[str]:
        sentences = filler_sentences(seed)
        first = True
        while True:
            chunk = " ".join(next(sentences) for _ in range(400))
            yield lead + chunk if first else " " + chunk
            first = False

    return tokenize_haystack(tokenizer, blocks(), n_tokens, source=f"builtin-filler(seed={seed})")


def file_haystack(tokenizer, path: str | Path, n_tokens: int, lead: str = "") -> Haystack:
    """At least `n_tokens` tokens of a UTF-8 text file; EvalError if it is missing or too short. `lead`: text put
    before the file's first character unless that is whitespace (as `builtin_haystack`'s)."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"haystack file {path} does not exist: give a UTF-8 text file, or omit --haystack "
                        "to use the built-in filler")
    text = read_utf8(path, "haystack file")  # replacement characters would be a haystack of garbage
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()  # of the file: `lead` is the caller's, not the file's
    if text and not text[0].isspace():
        text = lead + text
    hay = dataclasses.replace(tokenize_haystack(tokenizer, _split_blocks(text), n_tokens, source=str(path)),
                              digest=digest)
    if len(hay) < n_tokens:
        raise EvalError(f"haystack file {path} has {len(hay):,} tokens with this tokenizer but the largest length "
                        f"needs {n_tokens:,} haystack tokens (short by {n_tokens - len(hay):,}): give a longer file, "
                        "lower the largest length, or omit --haystack to use the built-in filler")
    return hay
