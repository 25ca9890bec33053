"""Needle in a haystack (NIAH), as in the UltraLong paper's heatmaps.

A prompt of exactly L tokens (counted by the model's tokenizer) is: an instruction, filler text
(the haystack) with one needle sentence "The special magic number is 4817263." put at a sentence
start nearest to depth d% of the haystack, then the question and the start of the answer. The
model continues greedily; the cell scores 1 when the first number it writes equals the value
(exact match), else 0. A grid of lengths x depths gives the heatmap.

The needle reads alike at every depth: after a full stop (the instruction ends in "Text:", the haystack starts
with a space), then a space and the next sentence (`PROMPT_VERSION`). The haystack part is the first tokens of one
stream, so it ends where the length cuts it, mid-sentence; a needle is therefore never put at that cut, but at the
last sentence start before it (the deepest depth is a little under 100%, `actual_depth` says where).

The `samples` prompts of a cell share the haystack and the needle's place and differ only in the value; the
haystack of a length is the first tokens of the same stream at every length. They are not independent draws.
"""

from __future__ import annotations

import random
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.generate import GenerateFn, SharedPrefixGreedy, eos_ids
from megatron_ext.evaluate.haystack import Haystack, builtin_haystack, file_haystack
from megatron_ext.evaluate.run_settings import (engine_settings, refuse_other_numerics, refuse_other_prompts,
                                                tokenizer_settings)
from megatron_ext.log_lines import log_line
from megatron_ext.progress import progress_bar

_MARK = "\u0000NIAH_HAYSTACK\u0000"  # where the haystack goes inside a chat template


@dataclass(frozen=True)
class NeedleTask:
    """The texts of a NIAH prompt; `{value}` in `needle` is replaced by a random `value_digits`-digit number."""

    instruction: str = ("There is a special magic number hidden inside the long text below. "
                        "Find it and remember it.\n\nText:")
    needle: str = " The special magic number is {value}."
    question: str = "\n\nWhat is the special magic number mentioned in the text above?"
    answer_prefix: str = " The special magic number is"
    value_digits: int = 7


def extract_value(text: str) -> str | None:
    """The first run of digits in a model's answer, or None when it wrote no number."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def score_output(text: str, value: str) -> float:
    """Exact match: 1.0 when the first number in `text` is exactly `value` (no extra or missing digits)."""
    return 1.0 if extract_value(text) == value else 0.0


def needle_value(seed: int, length: int, depth: float, sample: int, digits: int) -> str:
    """The cell's value: deterministic in (seed, length, depth, sample), `digits` digits, no leading zero."""
    rng = random.Random(f"{seed}:{length}:{depth}:{sample}")
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def prompt_parts(tokenizer, task: NeedleTask, chat: bool) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack: (head, tail).

    Plain: [BOS] + instruction | question + answer prefix. Chat: the tokenizer's chat template
    around a user message instruction + haystack + question, then the answer prefix after the
    assistant header (so instruct models answer in the scored form).
    """
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise EvalError("chat prompts need a tokenizer with a chat template; this one has none (drop --chat)")
        text = tokenizer.apply_chat_template([{"role": "user", "content": task.instruction + _MARK + task.question}],
                                             tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_MARK)
        return enc(head), enc(tail + task.answer_prefix.lstrip())
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + enc(task.instruction), enc(task.question + task.answer_prefix)


def build_prompt(haystack: Haystack, head: list[int], needle: list[int], tail: list[int], length: int,
                 depth: float) -> tuple[list[int], int, int]:
    """A prompt of exactly `length` tokens with the needle at the sentence start nearest to `depth`% (the end of
    the haystack part counts only where a sentence starts there: elsewhere it cuts a sentence).

    Returns (ids, needle_start, haystack_tokens): `needle_start` is the needle's first token index
    in `ids`; the haystack part is `haystack_tokens` long (needle excluded), so the needle sits
    after (needle_start - len(head)) of them.
    """
    n_hay = length - len(head) - len(needle) - len(tail)
    if n_hay < 0:
        raise EvalError(f"length {length} is shorter than the prompt without any haystack "
                        f"({length - n_hay} tokens): use lengths of at least {length - n_hay}")
    if n_hay > len(haystack):
        raise EvalError(f"haystack {haystack.source} has {len(haystack):,} tokens, length {length:,} needs {n_hay:,}")
    slots = haystack.needle_slots(n_hay)
    if not (haystack.starts == n_hay).any():
        slots = slots[:-1]  # the cut is mid-sentence: a needle there followed half a sentence without its full stop
    target = depth / 100.0 * n_hay
    at = int(slots[np.argmin(np.abs(slots - target))])  # first of two equally near slots
    ids = haystack.ids
    prompt = head + ids[:at].tolist() + needle + ids[at:n_hay].tolist() + tail
    return prompt, len(head) + at, n_hay


@dataclass
class NiahResult:
    """A NIAH grid. scores[i][j]: mean exact match at depths[i], lengths[j] (None: length skipped)."""

    lengths: list[int]
    depths: list[float]
    scores: list[list[float | None]]
    cells: list[dict] = field(default_factory=list)
    skipped_lengths: list[int] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """Mean score over the cells that ran."""
        vals = [s for row in self.scores for s in row if s is not None]
        return float(np.mean(vals)) if vals else float("nan")

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "NiahResult":
        return cls(**{k: d[k] for k in ("lengths", "depths", "scores", "cells", "skipped_lengths", "settings") if k in d})


def _check_grid(lengths, depths) -> tuple[list[int], list[float]]:
    lengths = sorted({int(x) for x in lengths})
    if not lengths or lengths[0] <= 0:
        raise EvalError(f"lengths must be positive token counts, got {lengths}")
    depths = sorted({float(d) for d in depths})
    bad = [d for d in depths if not 0.0 <= d <= 100.0]
    if not depths or bad:
        raise EvalError(f"depths are percentages in 0..100, got {bad or depths}")
    return lengths, depths


class PeriodicSave:
    """Hands `result()` to `on_progress` (None: nothing) when told (`now`), or when asked (`due`) once `every_s`
    have passed since the last time: a long sweep keeps what it did."""

    def __init__(self, on_progress: Callable | None, result: Callable, every_s: float):
        self.on_progress, self.result, self.every_s, self.last = on_progress, result, every_s, time.time()

    def now(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.result())
            self.last = time.time()

    def due(self) -> None:
        if time.time() - self.last >= self.every_s:
            self.now()


def lengths_within(lengths: list[int], max_pos: int | None, force: bool) -> tuple[list[int], list[int]]:
    """(to run, skipped): lengths above the model's `max_position_embeddings` are skipped with a warning unless
    `force`; EvalError when none is left."""
    over = [n for n in lengths if max_pos is not None and n > max_pos]
    if over:
        what = "running them anyway (forced)" if force else "skipping them (use --force to run)"
        warnings.warn(f"lengths {over} exceed the model's max_position_embeddings={max_pos}: {what}", stacklevel=3)
    skipped = [] if force else over
    todo = [n for n in lengths if n not in skipped]
    if not todo:
        raise EvalError(f"every length {lengths} exceeds the model's max_position_embeddings={max_pos}: "
                        "use shorter lengths or --force")
    return todo, skipped


def run_niah(model, tokenizer, lengths, depths, *, haystack: Haystack | str | Path | None = None,
             task: NeedleTask = NeedleTask(), samples: int = 1, seed: int = 0, chat: bool = False,
             max_new_tokens: int = 16, batch_tokens: int = 65536, prefill_chunk: int | str | None = "auto",
             allow_beyond_max_positions: bool = False, generate: GenerateFn | None = None,
             max_position_embeddings: int | None = None, previous: NiahResult | None = None,
             on_progress: Callable[[NiahResult], None] | None = None, save_every_s: float = 60.0,
             progress: bool = True, log: Callable[[str], None] | None = log_line,
             numerics: dict | None = None) -> NiahResult:
    """Run the NIAH grid `lengths` (tokens) x `depths` (percent) and score each cell by exact match.

    `haystack`: a Haystack, a text file path, or None for the built-in filler. Prompts of one
    length run as batches of up to `batch_tokens // length` rows (no padding: equal lengths).
    Lengths above the model's `max_position_embeddings` are skipped with a warning unless
    `allow_beyond_max_positions`. `generate` replaces greedy decoding (prompts [B, L] -> new ids
    per row); `model` may then be None (give `max_position_embeddings` for the check above). A
    `generate` with `takes_drafts = True` is also given each row's expected answer as a draft
    (`generate(ids, drafts)`; `megatron_ext.evaluate.parallel` checks it in the same forward pass).
    A batch that runs out of device memory is retried in halves; a single prompt that does is
    recorded as not run (score None). `on_progress` gets the grid so far after each length and after a batch
    once `save_every_s` have passed since the last call (tools/niah.py saves it, so a long sweep keeps what it did).
    `previous`: the grid of an earlier run with the same prompts (a sweep that was stopped); its scored cells are
    kept, the others run, unless it ran with other numerics (`run_settings.refuse_other_numerics`). `numerics`: the
    engine and dtype of a `generate` that runs without `model` (the Megatron engine's); with `model`, they are its
    own. `log` gets a `[niah] ...` line per length (default: printed after the local time), None is silent.
    """
    lengths, depths = _check_grid(lengths, depths)
    if samples < 1:
        raise EvalError(f"samples must be >= 1, got {samples}")
    if max_new_tokens < 1:  # no answer token: every cell would score 0 as if the model had missed
        raise EvalError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", max_position_embeddings)
    todo, skipped = lengths_within(lengths, max_pos, allow_beyond_max_positions)

    head, tail = prompt_parts(tokenizer, task, chat)
    cells = []  # one per (length, depth, sample), in run order
    for n in todo:
        for d in depths:
            for s in range(samples):
                value = needle_value(seed, n, d, s, task.value_digits)
                needle = tokenizer(task.needle.format(value=value), add_special_tokens=False)["input_ids"]
                cells.append({"length": n, "depth": d, "sample": s, "value": value, "needle_ids": needle})
    hay_tokens = [c["length"] - len(head) - len(tail) - len(c["needle_ids"]) for c in cells]
    if min(hay_tokens) < 0:
        shortest = min(c["length"] for c, h in zip(cells, hay_tokens) if h < 0)
        floor = max(c["length"] - h for c, h in zip(cells, hay_tokens))
        raise EvalError(f"length {shortest} is shorter than the prompt without any haystack ({floor} tokens: "
                        f"instruction, needle, question): use lengths of at least {floor}")
    need = max(hay_tokens)
    if isinstance(haystack, Haystack):
        hay = haystack
    elif haystack is None:  # a space before the first sentence: a needle at depth 0 is followed as anywhere else
        hay = builtin_haystack(tokenizer, need, seed=seed, lead=" ")
    else:
        hay = file_haystack(tokenizer, haystack, need, lead=" ")

    if generate is None:
        eos = eos_ids(model, tokenizer)
        generate = SharedPrefixGreedy(model, max_new_tokens, eos_token_ids=eos, prefill_chunk=prefill_chunk)
    settings = {"model": _model_name(model), "haystack": hay.source, "haystack_sha256": hay.digest,
                "task": asdict(task), "samples": samples,
                "seed": seed, "chat": chat, "max_new_tokens": max_new_tokens, "max_position_embeddings": max_pos,
                "prefill_chunk": prefill_chunk, "batch_tokens": batch_tokens,
                "prompt_overhead_tokens": len(head) + len(tail), "prompt_version": PROMPT_VERSION,
                **tokenizer_settings(tokenizer)}
    settings.update(engine_settings(model, numerics))

    kept = _keep_previous(cells, previous, settings) if previous is not None else 0
    if kept and log:
        log(f"[niah] {kept} of {len(cells)} cells kept from the earlier run")

    def result() -> NiahResult:  # the grid so far; cells not run yet (or out of memory) are None
        scores = []
        for d in depths:
            scores.append([_mean([c.get("score") for c in cells if c["length"] == n and c["depth"] == d])
                           for n in lengths])
        done = [c for c in cells if "needle_ids" not in c]
        return NiahResult(lengths, depths, scores, done, skipped, dict(settings))

    pending = [c for c in cells if "needle_ids" in c]
    bar = None
    if progress:
        bar = progress_bar(total=len(pending), desc="niah", unit="cell")
    start_all, saver = time.time(), PeriodicSave(on_progress, result, save_every_s)
    for k, n in enumerate(todo):
        # By depth, deeper and shallower by turns from length to length: consecutive prompts then share the
        # haystack before the shallower needle, and a length's first prompt the previous one's (the same haystack
        # is cut at every length). An engine that keeps its KV cache from prompt to prompt runs only the rest
        # (`parallel.MegatronGreedy`, `generate.SharedPrefixGreedy`).
        row = sorted((c for c in pending if c["length"] == n), key=lambda c: (c["depth"], c["sample"]),
                     reverse=k % 2 == 1)
        if not row:
            continue
        t0 = time.time()
        per_batch = max(1, batch_tokens // n)
        queue = [row[i:i + per_batch] for i in range(0, len(row), per_batch)]
        while queue:
            batch = queue.pop(0)
            prompts = []
            for c in batch:
                ids, pos, n_hay = build_prompt(hay, head, c["needle_ids"], tail, n, c["depth"])
                c.update(needle_token=pos, haystack_tokens=n_hay,
                         actual_depth=round(100.0 * (pos - len(head)) / max(n_hay, 1), 3))
                prompts.append(ids)
            try:
                ids = torch.tensor(prompts, dtype=torch.long)
                if getattr(generate, "takes_drafts", False):
                    outputs = generate(ids, [_answer_ids(tokenizer, task, c["value"]) for c in batch])
                else:
                    outputs = generate(ids)
            except torch.OutOfMemoryError:
                _free_device_memory()
                if len(batch) > 1:  # retry as two halves
                    half = len(batch) // 2
                    queue[:0] = [batch[:half], batch[half:]]
                    continue
                warnings.warn(f"length {n:,}, depth {batch[0]['depth']:g}%: out of memory even as a batch of 1; "
                              "recorded as not run (see the memory note)", stacklevel=2)
                outputs = [None]
            for c, out in zip(batch, outputs):
                del c["needle_ids"]
                if out is None:
                    c.update(output=None, score=None, error="out of memory")
                else:
                    c["output"] = tokenizer.decode(out, skip_special_tokens=True)
                    c["score"] = score_output(c["output"], c["value"])
            if bar is not None:
                bar.update(len(batch))
            if queue:
                saver.due()
        if log:
            everything = [c for c in cells if c["length"] == n]
            acc = _mean([c["score"] for c in everything])
            acc_text = "n/a" if acc is None else f"{acc:.2f}"
            log(f"[niah] length {n:>9,}: accuracy {acc_text} over {len(everything)} prompts ({len(row)} run, "
                f"{time.time() - t0:.1f}s)")
        saver.now()
    if bar is not None:
        bar.close()
    settings["seconds"] = round(time.time() - start_all, 2)
    if isinstance(generate, SharedPrefixGreedy):
        settings["shared_tokens"] = generate.shared_tokens
        generate.clear()
    return result()


# Settings that decide the prompts and the outputs: an earlier grid's cells count only if they agree.
# The form of the prompts: bumped whenever it changes, so --resume never mixes cells of two forms in one grid (2: the
# needle reads alike at every depth: the instruction ends in "Text:", the haystack starts with a space, and no needle
# follows the cut at the haystack's end).
PROMPT_VERSION = 2
_RESUME_SETTINGS = ("haystack", "task", "seed", "chat", "max_new_tokens", "prompt_overhead_tokens", "prompt_version")


def _keep_previous(cells: list[dict], previous: NiahResult, settings: dict) -> int:
    """Fill the cells an earlier run scored (same length, depth, sample and needle value) from `previous`; they
    lose `needle_ids` (done). Returns how many. EvalError when the earlier run made other prompts or ran with other
    numerics."""
    refuse_other_prompts(previous.settings, settings, _RESUME_SETTINGS)
    refuse_other_numerics(previous.settings, settings)
    done = {(c["length"], c["depth"], c["sample"], c["value"]): c for c in previous.cells
            if c.get("score") is not None}
    kept = 0
    for c in cells:
        old = done.get((c["length"], c["depth"], c["sample"], c["value"]))
        if old is not None:
            del c["needle_ids"]
            c.update({k: v for k, v in old.items() if k not in c})
            kept += 1
    return kept


def _answer_ids(tokenizer, task: NeedleTask, value: str) -> list[int]:
    """The expected continuation of the answer prefix: the needle sentence after it (" 4817263.")."""
    needle, prefix = task.needle.format(value=value), task.answer_prefix.strip()
    at = needle.find(prefix)
    text = needle[at + len(prefix):] if prefix and at >= 0 else f" {value}"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _free_device_memory() -> None:
    """Drop what the failed batch left on the GPU (its tensors die with the exception's frames)."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _model_name(model) -> str | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_name_or_path", None) or (type(model).__name__ if model is not None else None)
