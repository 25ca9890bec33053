"""RULER-style evaluation: the synthetic tasks of `ruler_tasks.py` x lengths x samples, scored by string match.

    result = run_ruler(model, tokenizer, ["niah_single_1", "vt", "cwe"], [4096, 8192], samples=4)
    print(result.table())

On an HF model (transformers, one device) or, through `run_ruler_megatron`, on a Megatron checkpoint over the
ranks of a job (TP x PP x CP, the evaluation engine of `parallel.py` with its KV cache). A cell is one sample;
its score is the fraction of the expected strings found in the greedy output (RULER's string_match_all); a
task's score at a length is the mean over its samples, and a length's average the mean over tasks.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.haystack import Haystack, builtin_haystack, file_haystack
from megatron_ext.evaluate.niah import (PeriodicSave, _free_device_memory, _mean, _model_name, lengths_within,
                                        refuse_other_prompts)
from megatron_ext.evaluate.ruler_tasks import TASKS, SampleBuilder, match_all, noise_haystack

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
              save_every_s: float = 60.0, progress: bool = True, log=print) -> RulerResult:
    """Run `tasks` (names in `ruler_tasks.TASKS`) at `lengths` (tokens) with `samples` prompts each.

    `haystack`: the filler of the retrieval tasks (a Haystack, a text file, or None for the built-in one).
    `max_new_tokens`: the answer budget of every task (default: each task's own, RULER's). `generate` replaces
    greedy decoding on `model` (which may then be None; give `max_position_embeddings`). Prompts of one task and
    length run in batches of up to `batch_tokens // length` rows. Lengths above the model's
    `max_position_embeddings` are skipped unless `allow_beyond_max_positions`. `previous`: an earlier run with the
    same settings; its scored cells are kept. `on_progress` gets the result so far after each task and length
    (and every `save_every_s` within one).
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

    kinds = {TASKS[t].haystack for t in tasks}
    haystacks = {}
    if "filler" in kinds:
        if isinstance(haystack, Haystack):
            haystacks["filler"] = haystack
        elif haystack is None:
            haystacks["filler"] = builtin_haystack(tokenizer, max(todo), seed=seed)
        else:
            haystacks["filler"] = file_haystack(tokenizer, haystack, max(todo))
    if "noise" in kinds:
        haystacks["noise"] = noise_haystack(tokenizer, max(todo))
    builder = SampleBuilder(tokenizer, haystacks, chat=chat)
    for t in tasks:  # a length too short for a task fails here, before any prompt runs
        builder.build(TASKS[t], min(todo), random.Random(f"{seed}:{t}:{min(todo)}:0"))

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
                "max_position_embeddings": max_pos, "prefill_chunk": prefill_chunk, "batch_tokens": batch_tokens}
    if model is not None:
        p = next(model.parameters())
        settings.update(device=str(p.device), dtype=str(p.dtype).replace("torch.", ""))

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
        from tqdm.auto import tqdm
        bar = tqdm(total=len(pending), desc="ruler", unit="prompt")
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
_RESUME_SETTINGS = ("haystack", "seed", "chat", "max_new_tokens")


def _keep_previous(cells: list[dict], previous: RulerResult, settings: dict) -> int:
    refuse_other_prompts(previous.settings, settings, _RESUME_SETTINGS)
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
