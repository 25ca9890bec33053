"""Pins of `megatron_ext.evaluate.niah` found by a mutation audit (round 6)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.evaluate import EvalError, run_niah
from megatron_ext.evaluate.haystack import Haystack
from megatron_ext.evaluate.niah import build_prompt
from tests.unit.test_evaluate import Recorder, _read_needle, make_tokenizer

HEAD, NEEDLE, TAIL = [1, 2], [900, 901], [3]


def _hay(n: int, every: int = 10) -> Haystack:
    return Haystack(np.arange(100, 100 + n), np.arange(0, n, every), "test")


def test_the_shortest_length_the_error_names_takes_an_empty_haystack():
    """"use lengths of at least F": F (head + needle + tail, no haystack) builds, F - 1 is refused."""
    floor = len(HEAD) + len(NEEDLE) + len(TAIL)
    with pytest.raises(EvalError, match=f"use lengths of at least {floor}"):
        build_prompt(_hay(50), HEAD, NEEDLE, TAIL, floor - 1, 50.0)
    assert build_prompt(_hay(50), HEAD, NEEDLE, TAIL, floor, 50.0) == (HEAD + NEEDLE + TAIL, len(HEAD), 0)


def test_a_haystack_exactly_as_long_as_the_length_needs_is_enough():
    """A --haystack file of exactly the tokens the largest length needs (file_haystack accepts it) builds; one
    token more is refused, naming both counts."""
    length = 40 + len(HEAD) + len(NEEDLE) + len(TAIL)
    ids, pos, n_hay = build_prompt(_hay(40), HEAD, NEEDLE, TAIL, length, 100.0)
    assert len(ids) == length and n_hay == 40 and ids[pos:pos + 2] == NEEDLE
    with pytest.raises(EvalError, match=f"has 40 tokens, length {length + 1} needs 41"):
        build_prompt(_hay(40), HEAD, NEEDLE, TAIL, length + 1, 100.0)


def test_of_two_equally_near_sentence_starts_the_shallower_takes_the_needle():
    """Depth 50% of a 30-token haystack is token 15, between the starts at 10 and 20: the needle goes to 10
    (deterministic placement, as documented)."""
    length = 30 + len(HEAD) + len(NEEDLE) + len(TAIL)
    _, pos, _ = build_prompt(_hay(40), HEAD, NEEDLE, TAIL, length, 50.0)
    assert pos - len(HEAD) == 10


@pytest.mark.parametrize("kwargs,message", [({"samples": 0}, "samples must be >= 1, got 0"),
                                            ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0")])
def test_run_niah_refuses_no_samples_and_no_answer_tokens(kwargs, message):
    """No samples crashed on an empty grid; no answer tokens scored every cell 0 as if the model missed: both are
    user errors before anything runs."""
    tok = make_tokenizer()
    with pytest.raises(EvalError, match=message):
        run_niah(None, tok, [128], [50], generate=Recorder(tok, _read_needle), max_position_embeddings=256,
                 progress=False, log=None, **kwargs)


def test_a_periodic_save_waits_every_s_again_after_each_save():
    """After a save the next one is `every_s` later: a sweep whose first minute had passed saved after every batch
    from then on (a grid of millions of cells written once per batch)."""
    import time

    from megatron_ext.evaluate.niah import PeriodicSave

    saved = []
    saver = PeriodicSave(saved.append, lambda: len(saved), every_s=3600.0)
    saver.due()
    assert saved == []  # control: within the hour
    saver.last = time.time() - 7200.0  # as if the sweep had run two hours since the last save
    saver.due()
    saver.due()
    assert saved == [0]


def test_the_haystack_is_built_for_the_longest_length():
    """Lengths far apart: the built-in haystack is as long as the longest prompt needs (built for the shortest, it
    was one block of filler, and the long length failed after the short one had run)."""
    tok = make_tokenizer()
    res = run_niah(None, tok, [100, 20_000], [50], generate=Recorder(tok, _read_needle),
                   max_position_embeddings=1 << 20, progress=False, log=None)
    assert res.accuracy == 1.0 and [c["length"] for c in res.cells] == [100, 20_000]


def test_a_length_of_several_batches_is_saved_after_each_batch_when_due():
    """`save_every_s=0`: the grid so far goes to `on_progress` after every batch of a length but its last, whose save
    is the one at the length's end, so a sweep stopped inside a long length keeps the prompts it ran."""
    tok = make_tokenizer()
    saved = []
    run_niah(None, tok, [128], [0, 25, 50, 75], generate=Recorder(tok, _read_needle), batch_tokens=128,
             max_position_embeddings=256, on_progress=lambda r: saved.append(len(r.cells)), save_every_s=0.0,
             progress=False, log=None)
    assert saved == [1, 2, 3, 4]  # after batches 1-3, then at the end of the length


def test_run_niah_frees_the_kept_cache_of_its_generator():
    """A `SharedPrefixGreedy` handed to run_niah holds no KV cache once the grid is done (the longest prompt's cache
    otherwise stays on the device until the generator is dropped)."""
    from megatron_ext.evaluate.generate import SharedPrefixGreedy
    from tests.unit.test_evaluate import make_model

    model, tok = make_model(), make_tokenizer()
    gen = SharedPrefixGreedy(model, 2)
    res = run_niah(None, tok, [96], [0, 100], generate=gen, batch_tokens=96, max_position_embeddings=256,
                   progress=False, log=None)  # one prompt per batch: the generator keeps its cache between them
    assert res.settings["shared_tokens"] > 0  # control: a cache was kept between the prompts
    assert len(res.cells) == 2 and gen.cache is None and res.settings["shared_tokens"] == gen.shared_tokens


def test_the_draft_of_an_answer_is_the_needle_after_the_answer_prefix():
    """A speculative generator's draft is what follows the answer prefix in the needle (" 4817263."); a needle
    without the prefix drafts the value alone. A wrong draft costs only speed (the engine checks it), so no grid
    showed it."""
    from megatron_ext.evaluate.niah import NeedleTask, _answer_ids

    tok = make_tokenizer()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert _answer_ids(tok, NeedleTask(), "4817263") == enc(" 4817263.")
    assert _answer_ids(tok, NeedleTask(needle=" The river is 12."), "12") == enc(" 12")


def test_a_grid_where_no_cell_ran_has_no_accuracy():
    """Every cell out of memory: the accuracy is NaN, not 0.0 (which reads as a model that missed every needle)."""
    import math

    from megatron_ext.evaluate.niah import NiahResult

    assert math.isnan(NiahResult([128], [0.0, 50.0], [[None], [None]]).accuracy)
    assert NiahResult([128], [0.0, 50.0], [[1.0], [None]]).accuracy == 1.0  # control: the cells that ran


def test_a_length_where_every_prompt_ran_out_of_memory_logs_no_accuracy():
    """The length's log line says "n/a", not an accuracy of 0.00 for prompts that never ran."""
    import torch

    def out_of_memory(ids):
        raise torch.OutOfMemoryError("injected")

    tok, lines = make_tokenizer(), []
    with pytest.warns(UserWarning, match="out of memory even as a batch of 1"):
        run_niah(None, tok, [128], [50], generate=out_of_memory, max_position_embeddings=256, progress=False,
                 log=lines.append)
    assert len(lines) == 1 and "accuracy n/a over 1 prompts" in lines[0]
