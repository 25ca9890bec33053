"""RULER-style synthetic tasks: prompts of a given token length with answers that can be checked.

RULER (Hsieh et al. 2024, arXiv 2404.06654; the paper reports "RULER <128K/<512K/<1M") goes beyond one needle:
several keys and values, distractor needles, a haystack made of needles, variable tracking across hops, and
aggregation (the most common and the most frequent words of a long list). Its 11 synthetic tasks are here under
their RULER names with RULER's settings (haystack kind, key and value kinds, needle counts, hops, word
frequencies, fwe's noise token and ranks 2-4, answer lengths, vt's and cwe's one solved example), but the wording,
word lists and filler are our own: the scores compare models, checkpoints and lengths under this stack, not with
published RULER tables (those need NVIDIA/RULER's templates and essays). RULER's two QA tasks need SQuAD and
HotpotQA and are not included (its average has 13 tasks, ours 11).

A prompt is [BOS] instruction, body, question, answer prefix (or the chat template around the first three, as
in `niah.prompt_parts`). vt and cwe prompts put before the instruction one example of the task with its answer
(`ruler_oneshot`), as RULER's do, where the length leaves room for it and the task's smallest prompt (every
length RULER uses does; prompts of a few hundred tokens do not): `details["solved_example"]` says which.
Retrieval and variable-tracking prompts are exactly `length` tokens (needle sentences put at sentence starts of
the filler); needle-haystack and word-list prompts are the longest list that fits.

A needle reads alike at every place it can go, as NIAH's (`niah.PROMPT_VERSION` 2): after a full stop and a space,
then a space and the next sentence. The instruction of a retrieval or vt prompt ends in "Text:" and the filler and
noise haystacks start with a space, so the first place is no different (it read "about them.\n\n The secret ... is
4817263.Nobody knows": a stray space, and the first sentence glued to the needle's full stop). The cut that ends the
haystack part, mid-sentence, is never a place (a needle there would follow half a sentence), nor is the sentence start
before it where the cut leaves only that sentence's space (a needle there was followed by " \n\n" and the question).
The word lists of cwe and fwe, put together from " word" tokens, follow "List:" and "Text:" in the same way (they
read "others.\n\n 1. word" before `ruler.PROMPT_VERSION` 4).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.haystack import Haystack, tokenize_haystack
from megatron_ext.evaluate.ruler_oneshot import cwe_example, cwe_wording, vt_example, vt_wording


class LengthTooShort(EvalError):
    """A length too short for a task's prompt (its question and needles, or its smallest list). Its own class so
    that `ruler.check_lengths` can look for the length that fits and let other errors (a haystack file without
    sentence ends, ...) through as they are."""


@dataclass(frozen=True)
class RulerTask:
    """One synthetic task. `kind`: niah, variable_tracking, common_words or frequent_words. For niah: `haystack`
    filler (the built-in filler or --haystack file), noise (one short paragraph repeated) or needles (the body is
    other keys' needles); `key`/`value`: word, number or uuid; `keys` needles with distinct keys (queried ones and
    distractors), `values` per queried key, `queries` keys asked for."""

    name: str
    kind: str = "niah"
    haystack: str = "filler"
    key: str = "word"
    value: str = "number"
    keys: int = 1
    values: int = 1
    queries: int = 1
    max_new_tokens: int = 128


# RULER's synthetic.yaml, task by task (QA left out).
TASKS: dict[str, RulerTask] = {t.name: t for t in (
    RulerTask("niah_single_1", haystack="noise"),
    RulerTask("niah_single_2"),
    RulerTask("niah_single_3", value="uuid"),
    RulerTask("niah_multikey_1", keys=4),
    RulerTask("niah_multikey_2", haystack="needles"),
    RulerTask("niah_multikey_3", haystack="needles", key="uuid", value="uuid"),
    RulerTask("niah_multivalue", values=4),
    RulerTask("niah_multiquery", keys=4, queries=4),
    # RULER gives vt 30 tokens for five 5-letter names; ours have 6 letters and may come back as "VAR NAME", so 50
    RulerTask("vt", kind="variable_tracking", haystack="noise", max_new_tokens=50),
    RulerTask("cwe", kind="common_words", max_new_tokens=120),
    RulerTask("fwe", kind="frequent_words", max_new_tokens=50),
)}
VT_HOPS = 4                      # VAR B = VAR A, ... : 5 names share the value
CWE_COMMON, CWE_FREQ, CWE_RARE_FREQ = 10, 30, 3
FWE_ALPHA, FWE_TOP = 2.0, 3      # Zipf exponent of the coded words; how many are asked for
FWE_NOISE = "..."                # fwe's most frequent "word", not asked for (RULER's)

_NOISE = ("The sky is clear and the air is still. The path goes on and the day goes by. "
          "Here we are, and here we stay. Back and forth the water moves.")  # digit-free, like the filler
_CONSONANTS, _VOWELS = "bdfghjklmnprstvwz", "aeiou"  # 85 syllables: 614,125 words of three
_WORDS = (len(_CONSONANTS) * len(_VOWELS)) ** 3
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@dataclass
class RulerSample:
    """A prompt (token ids) and the strings its answer must contain (`answers`, all of them to score 1)."""

    ids: list[int]
    answers: list[str]
    needle_tokens: list[int] = field(default_factory=list)  # first token of each needle sentence put in the body
    details: dict = field(default_factory=dict)  # what else varies from sample to sample


def match_all(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the fraction of `answers` found in `output` (case-insensitive substrings)."""
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def pseudo_words(rng: random.Random, n: int, taken: set[str] | None = None) -> list[str]:
    """`n` distinct pronounceable non-words of three syllables (`bolami`), none in `taken` (which they join). All of
    one length, so no answer word is part of another (the score looks for substrings)."""
    taken = set() if taken is None else taken
    if len(taken) + n > _WORDS:  # the rejection loop below would never end
        raise EvalError(f"RULER: {n} more distinct words asked with {len(taken)} taken, of the {_WORDS} there are (a "
                        "list of that many distinct words); use a shorter length for this task")
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def noise_haystack(tokenizer, n_tokens: int) -> Haystack:
    """At least `n_tokens` tokens of one short paragraph repeated (RULER's "noise" haystack), starting with a space
    (as every sentence after the first: a needle put before the first is followed as anywhere else)."""
    def blocks() -> Iterator[str]:
        chunk = " " + " ".join([_NOISE] * 200)
        while True:
            yield chunk

    return tokenize_haystack(tokenizer, blocks(), n_tokens, source="noise")


class SampleBuilder:
    """Makes the samples of the tasks for one tokenizer: `build(task, length, rng)`. `haystacks` maps filler and
    noise to a Haystack of at least the longest length (the caller builds them once)."""

    def __init__(self, tokenizer, haystacks: dict[str, Haystack], chat: bool = False):
        self.tok, self.haystacks, self.chat = tokenizer, haystacks, chat
        self._number_ids: list[list[int]] = [[]]  # entry i: the ids of " i."
        self._number_tokens: list[int] = [0]  # entry i: len of entries 1..i together

    def enc(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens. Straight through the Rust tokenizer where there is one: the
        transformers wrapper costs ~18 us a text in Python, 30 s for the million numbers of a 4M-token list."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def build(self, task: RulerTask, length: int, rng: random.Random) -> RulerSample:
        """The sample of `task` at `length` tokens drawn from `rng` (LengthTooShort: no prompt of it fits)."""
        make = {"niah": self._niah, "variable_tracking": self._variable_tracking, "common_words": self._common_words,
                "frequent_words": self._frequent_words}[task.kind]
        if task.kind not in ("variable_tracking", "common_words"):
            return make(task, length, rng)
        # RULER's solved example first; where it leaves no room for the task's smallest prompt, the prompt without
        # it (the RNG rewound: the one this seed gave before there were examples)
        state = rng.getstate()
        try:
            sample, example = make(task, length, rng, example=True), True
        except LengthTooShort:
            rng.setstate(state)
            sample, example = make(task, length, rng, example=False), False
        sample.details["solved_example"] = example
        return sample

    def _parts(self, instruction: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        from megatron_ext.evaluate.niah import prompt_parts  # imports torch: not for the task table (--help)

        return prompt_parts(self.tok, SimpleNamespace(instruction=instruction, question=question,
                                                      answer_prefix=answer_prefix), self.chat)

    # -------------------------------------------------------------------------------------------- retrieval

    def _niah(self, task: RulerTask, length: int, rng: random.Random) -> RulerSample:
        what = "number" if task.value == "number" else "code"
        taken: set[str] = set()
        keys = [self._key(task.key, rng, taken) for _ in range(task.keys)]
        asked = keys[:task.queries]
        values = {k: [self._value(task.value, rng) for _ in range(task.values if k in asked else 1)] for k in keys}
        lines = [f" The secret {what} of {k} is {v}." for k in keys for v in values[k]]
        rng.shuffle(lines)
        many = task.values > 1 or task.queries > 1
        names = _and_list(asked)
        instruction = (f"Secret {what}s of several names are hidden in the text below. Find them and remember "
                       f"them; you will be asked about them.\n\nText:")
        question = (f"\n\nWhat {'are all the secret ' + what + 's' if many else 'is the secret ' + what} of "
                    f"{names} in the text above?")
        prefix = f" The secret {what}{'s' if many else ''} of {names} {'are' if many else 'is'}"
        head, tail = self._parts(instruction, question, prefix)
        answers = [v for k in asked for v in values[k]]
        if task.haystack == "needles":
            return self._needle_haystack(task, length, rng, head, tail, lines, what, taken, answers)
        return self._in_haystack(self.haystacks[task.haystack], length, rng, head, tail, self.enc(lines), answers,
                                 task.name)

    def _key(self, kind: str, rng: random.Random, taken: set[str]) -> str:
        """A key no other needle of the prompt has (`taken`, which it joins): a uuid, or two pseudo-words joined by
        a hyphen (`bolami-tuveko`). Words may recur across keys, pairs do not, like RULER's adjective-noun keys: the
        614,125 x 614,124 pairs never run out, where distinct words ran out after 307,062 keys (niah_multikey_2 at 4M
        tokens holds about 260,000 needles)."""
        while True:
            if kind == "uuid":
                key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            else:
                key = "-".join(pseudo_words(rng, 2))
            if key not in taken:
                taken.add(key)
                return key

    def _value(self, kind: str, rng: random.Random) -> str:
        if kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return str(rng.randrange(1_000_000, 10_000_000))

    def _needle_haystack(self, task, length, rng, head, tail, lines, what, taken, answers) -> RulerSample:
        """The body is needles only: the task's own and as many distractors (other keys) as fit, shuffled."""
        budget = length - len(head) - len(tail)
        mine = self.enc(lines)
        used = sum(map(len, mine))
        if used > budget:
            raise LengthTooShort(f"{task.name}: length {length} is too short for the question and its needle "
                                 f"({length - budget + used} tokens): use a longer length")
        body = list(mine)
        while True:
            extra = [f" The secret {what} of {self._key(task.key, rng, taken)} is {self._value(task.value, rng)}."
                     for _ in range(max(16, (budget - used) // max(1, len(mine[0])) + 1))]
            for ids in self.enc(extra):
                if used + len(ids) > budget:
                    break
                body.append(ids)
                used += len(ids)
            else:
                continue
            break
        order = list(range(len(body)))
        rng.shuffle(order)
        ids, where = list(head), {}
        for i in order:
            where[i] = len(ids)
            ids += body[i]
        return RulerSample(ids + tail, answers, sorted(where[i] for i in range(len(mine))))

    def _in_haystack(self, hay: Haystack, length, rng, head, tail, needles: list[list[int]], answers,
                     name: str) -> RulerSample:
        """Exactly `length` tokens: the haystack's first tokens with the needles, in the given order, at distinct
        random sentence starts of which at least a word is before the cut (each needle is followed by one)."""
        n_hay = length - len(head) - len(tail) - sum(map(len, needles))
        if n_hay < 0:
            raise LengthTooShort(f"{name}: length {length} is shorter than its prompt without any haystack "
                                 f"({length - n_hay} tokens): use lengths of at least {length - n_hay}")
        if n_hay > len(hay):
            raise EvalError(f"{name}: haystack {hay.source} has {len(hay):,} tokens, length {length:,} needs {n_hay:,}")
        slots = hay.needle_slots(n_hay)[:-1].tolist()  # sentence starts, not the cut at the end
        if slots and not self.tok.decode(hay.ids[slots[-1]:n_hay].tolist()).strip():
            slots.pop()  # the cut leaves only the space before that sentence: a needle there was followed by " \n\n"
        if len(slots) < len(needles):
            raise LengthTooShort(f"{name}: length {length} leaves {len(slots)} places for {len(needles)} needles: "
                                 "use a longer length")
        at = sorted(rng.sample(slots, len(needles)))
        ids, starts, prev = list(head), [], 0
        for pos, needle in zip(at, needles):
            ids += hay.ids[prev:pos].tolist()
            starts.append(len(ids))
            ids += needle
            prev = pos
        ids += hay.ids[prev:n_hay].tolist() + tail
        return RulerSample(ids, answers, starts)

    # ------------------------------------------------------------------------------------ multi-hop tracing

    def _variable_tracking(self, task: RulerTask, length: int, rng: random.Random, example: bool) -> RulerSample:
        taken: set[str] = set()
        names = [w.upper() for w in pseudo_words(rng, VT_HOPS + 1, taken)]
        value = str(rng.randrange(10_000, 100_000))
        lines = [f" VAR {names[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        instruction, question, prefix = vt_wording(value)
        shot = vt_example(rng, lambda n: [w.upper() for w in pseudo_words(rng, n, taken)], value, VT_HOPS, _NOISE,
                          lambda text: len(self.enc([text])[0])) if example else ""
        head, tail = self._parts(shot + instruction, question, prefix)
        return self._in_haystack(self.haystacks[task.haystack], length, rng, head, tail, self.enc(lines), names,
                                 task.name)

    # ---------------------------------------------------------------------------------------- aggregation

    def _common_words(self, task: RulerTask, length: int, rng: random.Random, example: bool) -> RulerSample:
        common = pseudo_words(rng, CWE_COMMON)
        rare_stream = random.Random(rng.random())
        rare: list[str] = []
        taken = set(common)  # the example's words join it before any rare word is drawn: no word is in both lists
        top = _NUMBER_WORDS[CWE_COMMON]
        shot = cwe_example(rng, lambda n: pseudo_words(rng, n, taken), length, CWE_COMMON, top) if example else ""
        instruction, question, prefix = cwe_wording(top)
        head, tail = self._parts(shot + instruction, question, prefix)
        # A length too short for 10 words x 30 and as many rare words lowers the common words' count (down to one more
        # than the rare ones')
        for freq in range(CWE_FREQ, CWE_RARE_FREQ, -1):
            def words(n_rare: int) -> list[tuple[str, int]]:  # the first n_rare of one stream of rare words
                rare.extend(pseudo_words(rare_stream, n_rare - len(rare), taken))
                return [(w, freq) for w in common] + [(w, CWE_RARE_FREQ) for w in rare[:n_rare]]

            try:
                sample = self._fit_list(task.name, length, rng, head, tail, words, common, lo=CWE_COMMON,
                                        numbered=True)
            except EvalError:
                if freq == CWE_RARE_FREQ + 1:
                    raise
                continue
            sample.details["common_word_count"] = freq
            return sample
        raise AssertionError("unreachable")

    def _frequent_words(self, task: RulerTask, length: int, rng: random.Random) -> RulerSample:
        vocab_rng = random.Random(rng.random())
        # As RULER: the Zipf law's first rank is the noise token "...", which the question says to ignore, and the
        # answer is ranks 2-4 (the first rank alone is ~61% of the text: asked for, it was nearly free)
        vocab: list[str] = [FWE_NOISE]

        def words(top_count: int) -> list[tuple[str, int]]:
            counts = zipf_counts(top_count, FWE_ALPHA)
            vocab.extend(pseudo_words(vocab_rng, len(counts) - len(vocab), set(vocab)))
            return list(zip(vocab, counts))

        head, tail = self._parts(
            "Below is a text of coded words. Keep count of how often each coded word appears.\n\nText:",
            f"\n\nWhat are the {_NUMBER_WORDS[FWE_TOP]} most frequent coded words in the text above? Ignore the "
            f"dots '{FWE_NOISE}'.",
            f" The {_NUMBER_WORDS[FWE_TOP]} most frequent coded words are:")
        # floor(c / k^2) for k = 2..5 has no ties among ranks 2-4 (nor with the 5th) from c = 36 on
        sample = self._fit_list(task.name, length, rng, head, tail, words, [], lo=36, numbered=False)
        sample.answers = vocab[1:1 + FWE_TOP]
        return sample

    def _fit_list(self, name: str, length: int, rng: random.Random, head, tail, counts_for, answers, lo: int,
                  numbered: bool) -> RulerSample:
        """The prompt whose body is the words of `counts_for(n)` ([(word, times)]) shuffled, for the largest
        `n >= lo` that fits in `length` tokens: numbered items " 1. word 2. word" (`numbered`) or words with a period
        after every 12th. Items are put together from each word's and number's own tokens, so a size is arithmetic
        on cached token counts (a 4M-token list is found in seconds)."""
        budget = length - len(head) - len(tail)
        word_ids: dict[str, list[int]] = {}
        period = self.enc(["."])[0]

        def size(n: int) -> int:
            pairs = counts_for(n)
            new = [w for w, _ in pairs if w not in word_ids]
            if new:
                word_ids.update(zip(new, self.enc([" " + w for w in new])))
            items = sum(c for _, c in pairs)
            total = sum(c * len(word_ids[w]) for w, c in pairs)
            if numbered:
                self._numbers(items)
                return total + self._number_tokens[items]
            return total + len(period) * (items // 12)

        if size(lo) > budget:
            raise LengthTooShort(f"{name}: length {length} is too short for its smallest list "
                                 f"({len(head) + len(tail) + size(lo)} tokens): use a longer length")
        hi = max(lo + 1, 2 * lo)
        while size(hi) <= budget:  # doubling, then bisection
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
        words = [w for w, c in counts_for(lo) for _ in range(c)]
        rng.shuffle(words)
        body: list[int] = []
        for i, w in enumerate(words):
            if numbered:
                body += self._number_ids[i + 1]
            body += word_ids[w]
            if not numbered and i % 12 == 11:
                body += period
        return RulerSample(list(head) + body + list(tail), list(answers), [])

    def _numbers(self, n: int) -> None:
        """Token ids of " 1." .. " n." in `self._number_ids[1..n]`, and in `self._number_tokens[i]` how many tokens
        " 1." .. " i." take together (kept across samples)."""
        have = len(self._number_ids)
        if have <= n:
            more = self.enc([f" {i}." for i in range(have, max(n + 1, 2 * have))])
            self._number_ids += more
            for ids in more:
                self._number_tokens.append(self._number_tokens[-1] + len(ids))


def zipf_counts(top_count: int, alpha: float) -> list[int]:
    """Word counts of a Zipf law: rank k appears floor(top_count / k**alpha) times (ranks with 0 left out)."""
    counts, k = [], 1
    while (c := int(top_count / k ** alpha)) > 0:
        counts.append(c)
        k += 1
    return counts


def _and_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def task_names(spec: str) -> list[str]:
    """A comma list of task names and groups (all; niah: the 8 retrieval tasks) -> task names, in TASKS' order."""
    groups = {"all": list(TASKS), "niah": [n for n in TASKS if n.startswith("niah_")]}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in TASKS and n not in groups]
    if bad or not names:
        raise EvalError(f"--tasks: {', '.join(bad) or repr(spec)} is not a task; use all, niah, or a comma list of "
                        f"{', '.join(TASKS)}")
    chosen = {t for n in names for t in groups.get(n, [n])}
    return [t for t in TASKS if t in chosen]
