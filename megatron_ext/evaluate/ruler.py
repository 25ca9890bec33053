"""RULER-style evaluation: the synthetic tasks of `ruler_tasks.py` x lengths x samples, scored by string match.

    result = run_ruler(model, tokenizer, ["niah_single_1", "vt", "cwe"], [4096, 8192], samples=4)
    print(result.table())

On an HF model (transformers, one device) or, through `run_ruler_megatron`, on a Megatron checkpoint over the
ranks of a job (TP x PP x CP, the evaluation engine of `parallel.py` with its KV cache). A cell is one sample;
its score is the fraction of the expected strings found in the greedy output (RULER's string_match_all); a
task's score at a length is the mean over its samples, and a length's average the mean over tasks.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.haystack import Haystack, builtin_haystack, file_haystack
from megatron_ext.evaluate.niah import PeriodicSave, _free_device_memory, _mean, _model_name, lengths_within
from megatron_ext.evaluate.run_settings import (engine_settings, refuse_other_numerics, refuse_other_prompts,
                                                tokenizer_settings)
from megatron_ext.evaluate.ruler_tasks import TASKS, LengthTooShort, SampleBuilder, match_all, noise_haystack
from megatron_ext.log_lines import log_line
from megatron_ext.progress import progress_bar

RulerGenerate = Callable[[Sequence[Sequence[int]], int], list[list[int]]]
"""prompts (rows of token ids; equal lengths unless the function has `ragged = True`), max new tokens -> new ids.
The default (transformers) and the Megatron engine's take rows of any lengths."""


@dataclass
class RulerResult:
    """scores[task][j]: mean match of the task's samples at lengths[j] (None: not run)."""

    tasks: list[str]
    lengths: list[int]
    scores: dict[str, list[float | None]]
    cells: list[dict] = field(default_factory=list)
    skipped_lengths: list[int] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def averages(self) -> list[float | None]:
        """Per length, the mean over the tasks scored there."""
        return [_mean([self.scores[t][j] for t in self.tasks]) for j in range(len(self.lengths))]

    @property
    def accuracy(self) -> float:
        """Mean over every task and length scored."""
        vals = [s for row in self.scores.values() for s in row if s is not None]
        return float(np.mean(vals)) if vals else float("nan")

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "averages": self.averages(), **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "RulerResult":
        return cls(**{k: d[k] for k in ("tasks", "lengths", "scores", "cells", "skipped_lengths", "settings")
                      if k in d})

    def table(self) -> str:
        """Markdown: a row per task and the average, a column per length, scores in percent."""
        def pct(v: float | None) -> str:
            return "-" if v is None else f"{100 * v:.1f}"

        head = "| task | " + " | ".join(f"{n:,}" for n in self.lengths) + " |"
        rows = [head, "|---|" + "---:|" * len(self.lengths)]
        rows += [f"| {t} | " + " | ".join(pct(v) for v in self.scores[t]) + " |" for t in self.tasks]
        rows.append("| **average** | " + " | ".join(pct(v) for v in self.averages()) + " |")
        return "\n".join(rows)


def run_ruler(model, tokenizer, tasks: Sequence[str], lengths: Sequence[int], *, samples: int = 4, seed: int = 0,
              chat: bool = False, haystack: Haystack | str | Path | None = None, max_new_tokens: int | None = None,
              generate: RulerGenerate | None = None, batch_tokens: int = 65536,
              prefill_chunk: int | str | None = "auto",
              allow_beyond_max_positions: bool = False, max_position_embeddings: int | None = None,
              previous: RulerResult | None = None, on_progress: Callable[[RulerResult], None] | None = None,
              save_every_s: float = 60.0, progress: bool = True,
              log: Callable[[str], None] | None = log_line, numerics: dict | None = None) -> RulerResult:
    """Run `tasks` (names in `ruler_tasks.TASKS`) at `lengths` (tokens) with `samples` prompts each.

    `haystack`: the filler of the retrieval tasks (a Haystack, a text file, or None for the built-in one).
    `max_new_tokens`: the answer budget of every task (default: each task's own, RULER's). `generate` replaces
    greedy decoding on `model` (which may then be None; give `max_position_embeddings`). Prompts of one task and
    length run in batches of up to `batch_tokens // length` rows. Lengths above the model's
    `max_position_embeddings` are skipped unless `allow_beyond_max_positions`. `previous`: an earlier run with the
    same settings and numerics (engine, dtype, tokenizer: `run_settings.refuse_other_numerics`; `numerics`: those of a
    `generate` without `model`, as in `run_niah`); its scored cells are kept. `on_progress` gets the result so far after each task and length
    (and every `save_every_s` within one). `log` gets a `[ruler] ...` line per task and length (default: printed
    after the local time), None is silent.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise EvalError(f"unknown RULER tasks {unknown or tasks}; choose from {', '.join(TASKS)}")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] <= 0:
        raise EvalError(f"lengths must be positive token counts, got {lengths}")
    if samples < 1:
        raise EvalError(f"samples must be >= 1, got {samples}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tasks = list(dict.fromkeys(tasks))
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", max_position_embeddings)
    todo, skipped = lengths_within(lengths, max_pos, allow_beyond_max_positions)

    # A length too short for a task fails here, for all tasks and lengths in one error, before any prompt runs
    check_lengths(tokenizer, tasks, todo, samples=samples, seed=seed, chat=chat, haystack=haystack)
    haystacks = _haystacks(tokenizer, {TASKS[t].haystack for t in tasks}, haystack, max(todo), seed)
    builder = SampleBuilder(tokenizer, haystacks, chat=chat)

    if generate is None:
        from megatron_ext.evaluate.generate import eos_ids, greedy_generate_rows

        eos = eos_ids(model, tokenizer)

        def generate(prompts, n_new):  # the list-filled tasks' prompts differ by a few tokens: left-padded together
            return greedy_generate_rows(model, prompts, n_new, eos_token_ids=eos, prefill_chunk=prefill_chunk)
        generate.ragged = True
    ragged = getattr(generate, "ragged", False)
    settings = {"model": _model_name(model), "haystack": haystacks["filler"].source if "filler" in haystacks else None,
                "haystack_sha256": haystacks["filler"].digest if "filler" in haystacks else None,
                "samples": samples, "seed": seed, "chat": chat, "max_new_tokens": max_new_tokens,
                "prompt_version": PROMPT_VERSION,
                "max_position_embeddings": max_pos, "prefill_chunk": prefill_chunk, "batch_tokens": batch_tokens,
                **tokenizer_settings(tokenizer)}
    settings.update(engine_settings(model, numerics))

    cells = [{"task": t, "length": n, "sample": s} for n in todo for t in tasks for s in range(samples)]
    kept = _keep_previous(cells, previous, settings) if previous is not None else 0
    if kept and log:
        log(f"[ruler] {kept} of {len(cells)} cells kept from the earlier run")

    def result() -> RulerResult:
        scores = {t: [_mean([c.get("score") for c in cells if c["task"] == t and c["length"] == n]) for n in lengths]
                  for t in tasks}
        return RulerResult(tasks, lengths, scores, [c for c in cells if "output" in c], skipped, dict(settings))

    bar = None
    pending = [c for c in cells if "output" not in c]
    if progress:
        bar = progress_bar(total=len(pending), desc="ruler", unit="prompt")
    start_all, saver = time.time(), PeriodicSave(on_progress, result, save_every_s)
    for n in todo:
        for t in tasks:
            group = [c for c in pending if c["task"] == t and c["length"] == n]
            if not group:
                continue
            t0, task = time.time(), TASKS[t]
            new_tokens = max_new_tokens or task.max_new_tokens
            per_batch = max(1, batch_tokens // n)
            for batch, prompts in _batches(group, per_batch, ragged, lambda c: builder.build(
                    task, n, random.Random(f"{seed}:{t}:{n}:{c['sample']}"))):
                outputs = _generate_or_none(generate, prompts, new_tokens, n)
                for c, out in zip(batch, outputs):
                    if out is None:
                        c.update(output=None, score=None, error="out of memory")
                    else:
                        c["output"] = tokenizer.decode(out, skip_special_tokens=True)
                        c["score"] = match_all(c["output"], c["answers"])
                if bar is not None:
                    bar.update(len(batch))
                saver.due()
            if log:
                score = _mean([c.get("score") for c in cells if c["task"] == t and c["length"] == n])
                log(f"[ruler] {t:<16} {n:>9,} tokens: {'n/a' if score is None else f'{100 * score:5.1f}'} over "
                    f"{samples} samples ({len(group)} run, {time.time() - t0:.1f}s)")
            saver.now()
    if bar is not None:
        bar.close()
    settings["seconds"] = round(time.time() - start_all, 2)
    return result()


def _haystacks(tokenizer, kinds: set[str], haystack: Haystack | str | Path | None, n_tokens: int,
               seed: int) -> dict[str, Haystack]:
    """The filler and noise haystacks the tasks' `kinds` use, of at least `n_tokens` tokens (a given Haystack as
    it is). A longer one starts with the same tokens, so a prompt does not depend on how long its haystack is. Both
    start with a space: a needle at the first place follows the instruction's "Text:" as others follow a sentence."""
    haystacks = {}
    if "filler" in kinds:
        if isinstance(haystack, Haystack):
            haystacks["filler"] = haystack
        elif haystack is None:
            haystacks["filler"] = builtin_haystack(tokenizer, n_tokens, seed=seed, lead=" ")
        else:
            haystacks["filler"] = file_haystack(tokenizer, haystack, n_tokens, lead=" ")
    if "noise" in kinds:
        haystacks["noise"] = noise_haystack(tokenizer, n_tokens)
    return haystacks


def check_lengths(tokenizer, tasks: Sequence[str], lengths: Sequence[int], *, samples: int = 1, seed: int = 0,
                  chat: bool = False, haystack: Haystack | str | Path | None = None, what: str = "lengths") -> None:
    """EvalError, in one line, when lengths are too short for some of `tasks`: those lengths, each task with the
    length it needs, and the smallest length every task takes (`what`: how the message names the lengths).

    No model, and prompts of a few hundred tokens: tools/niah.py ruler calls it before loading the model (the
    tasks failed one at a time, each after minutes of loading). A prompt's size varies by a few tokens with its
    sample and length (keys, values, where the haystack's sentences start), so a task does not take every length
    above the shortest it takes: a length is checked on the prompts the run builds (samples 0 .. `samples` - 1, the
    run's seeds), and lengths of at least twice a task's shortest are taken as they are (a million-token prompt
    takes seconds to build, and the run builds it anyway).
    """
    tasks, lengths = list(dict.fromkeys(tasks)), sorted(set(lengths))
    kinds = {TASKS[t].haystack for t in tasks}
    built: list = [0, None]  # haystack tokens, SampleBuilder: grown as longer prompts are tried

    def build(t: str, n: int, upto: int = samples) -> None:  # LengthTooShort when a sample < `upto` does not fit
        if n > built[0]:  # grown geometrically: a haystack is tokenized again from its start
            size = max(n, 2 * built[0], 4096)
            try:
                hay = _haystacks(tokenizer, kinds, haystack, size, seed)
            except EvalError:  # a --haystack file shorter than `size`: as long as `n` needs, or its own error
                size, hay = n, _haystacks(tokenizer, kinds, haystack, n, seed)
            built[:] = [size, SampleBuilder(tokenizer, hay, chat=chat)]
        for s in range(upto):
            built[1].build(TASKS[t], n, random.Random(f"{seed}:{t}:{n}:{s}"))

    def fits(t: str, n: int, upto: int = samples) -> bool:
        try:
            build(t, n, upto)
        except LengthTooShort:
            return False
        return True

    # Where the first sample starts to fit (samples differ by a few percent: the lengths below twice that are
    # then checked with all of them). Past twice the longest length asked for, the task's own error says why not.
    limit = max(2 * lengths[-1], 4096)
    shortest = {t: _shortest_fit(lambda n: fits(t, n, 1), lambda n: build(t, n, 1), limit) for t in tasks}
    short = {n: [t for t in tasks if n < 2 * shortest[t] and not fits(t, n)] for n in lengths}
    short = {n: names for n, names in short.items() if names}
    if not short:
        return
    named = [t for t in tasks if any(t in names for names in short.values())]
    # A task's need: the first length that fits all its samples above every length that failed for it (one may
    # fail above the shortest that fits, where prompts vary); the smallest is checked on every task's samples.
    needs = {t: next(n for n in itertools.count(max([shortest[t]] + [m + 1 for m, names in short.items()
                                                                     if t in names])) if fits(t, n))
             for t in named}
    smallest = next(n for n in itertools.count(max(needs.values())) if all(fits(t, n) for t in tasks))
    parts = [f"{t} (needs >= {needs[t]} tokens)" for t in named]
    raise EvalError(f"{what} {','.join(map(str, short))}: too short for "
                    f"{', '.join(parts[:-1]) + ' and ' if len(parts) > 1 else ''}{parts[-1]}; the smallest length "
                    f"all selected tasks take is {smallest} ({max(named, key=needs.get)} needs the most): use "
                    f"{what} of at least {smallest}")


def _shortest_fit(fits: Callable[[int], bool], build: Callable[[int], None], limit: int) -> int:
    """A length `fits` takes with `fits(n - 1)` False, by doubling from 64 tokens, then bisection. Past `limit`,
    `build` (which raises where `fits` is False) raises the task's own error at the last length tried."""
    lo, hi = 0, 64
    while not fits(hi):
        if hi >= limit:
            build(hi)
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _batches(group: list[dict], per_batch: int, ragged: bool, build) -> Iterator[tuple[list[dict], list[list[int]]]]:
    """(cells, prompts) of up to `per_batch` rows, the prompts made batch by batch (`build(cell)` -> RulerSample,
    whose answers go into the cell); rows of one length each unless the generator takes ragged rows."""
    for i in range(0, len(group), per_batch):
        by_length: dict[int, tuple[list, list]] = {}
        for c in group[i:i + per_batch]:
            sample = build(c)
            c.update(answers=sample.answers, prompt_tokens=len(sample.ids), needle_tokens=sample.needle_tokens,
                     **sample.details)
            rows = by_length.setdefault(0 if ragged else len(sample.ids), ([], []))
            rows[0].append(c)
            rows[1].append(sample.ids)
        yield from by_length.values()


def _generate_or_none(generate: RulerGenerate, prompts: list[list[int]], new_tokens: int, length: int) -> list:
    """New ids per prompt; a batch out of device memory runs again one prompt at a time, and a single prompt that
    runs out is None (recorded as not run)."""
    try:
        return generate(prompts, new_tokens)
    except torch.OutOfMemoryError:
        _free_device_memory()
    if len(prompts) > 1:
        return [out for p in prompts for out in _generate_or_none(generate, [p], new_tokens, length)]
    import warnings

    warnings.warn(f"a {length:,}-token RULER prompt ran out of memory even alone; recorded as not run", stacklevel=2)
    return [None]


# Settings that decide the prompts and the outputs: an earlier run's cells count only if they agree.
# The form of the prompts: bumped whenever a task's text changes (2: vt and cwe open with a solved example, as
# RULER's do; 3: a needle reads alike at every place, as NIAH's since its prompt_version 2: the retrieval and vt
# instructions end in "Text:" and the filler and noise haystacks start with a space; 4: so do cwe's and fwe's, in
# "List:" and "Text:", whose word lists followed a blank line with a space), so --resume never mixes cells of two
# forms in one score.
PROMPT_VERSION = 4
_RESUME_SETTINGS = ("haystack", "seed", "chat", "max_new_tokens", "prompt_version")


def _keep_previous(cells: list[dict], previous: RulerResult, settings: dict) -> int:
    refuse_other_prompts(previous.settings, settings, _RESUME_SETTINGS)
    refuse_other_numerics(previous.settings, settings)
    done = {(c["task"], c["length"], c["sample"]): c for c in previous.cells if c.get("score") is not None}
    kept = 0
    for c in cells:
        old = done.get((c["task"], c["length"], c["sample"]))
        if old is not None:
            c.update(old)
            kept += 1
    return kept


def run_ruler_megatron(checkpoint, tasks, lengths, *, tensor: int = 1, pipeline: int = 1, context: int = 1,
                       device: str | None = None, dtype: str | None = None, tokenizer=None, kv_cache: bool = True,
                       on_progress=None, progress: bool = True, **ruler_kwargs) -> RulerResult:
    """`run_ruler` on a Megatron checkpoint over this job's ranks (see `engine.megatron_engine`). Every rank runs
    it; rank 0 gets `on_progress`, the progress bar and the log. The DP replicas share each batch's prompts."""
    from megatron_ext.evaluate.engine import megatron_engine

    with megatron_engine(checkpoint, tensor=tensor, pipeline=pipeline, context=context, device=device, dtype=dtype,
                         tokenizer=tokenizer) as engine:
        greedy = engine.greedy(1, kv_cache=kv_cache, until_number=False)

        def generate(prompts, n_new):
            greedy.max_new_tokens = n_new
            return greedy(prompts)

        generate.ragged = True  # each row runs alone through the engine: any lengths in one call
        longest = engine.announce("ruler", lengths, greedy, ruler_kwargs.get("allow_beyond_max_positions", False))
        result = run_ruler(None, engine.tokenizer, tasks, lengths, generate=generate,
                           **engine.run_arguments(longest, on_progress, progress), **ruler_kwargs)
        engine.record(result.settings, greedy)
        return result
