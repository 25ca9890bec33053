"""Pins of `megatron_ext.evaluate.ruler` found by a mutation audit (round 6)."""

from __future__ import annotations

import pytest

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.ruler import run_ruler
from tests.unit.test_evaluate import make_tokenizer


def _never(prompts, n_new):
    raise AssertionError("nothing runs for a request refused up front")


@pytest.mark.parametrize("tasks,kwargs,message", [
    ([], {}, "unknown RULER tasks"),
    (["vt"], {"samples": 0}, "samples must be >= 1, got 0"),
    (["vt"], {"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
])
def test_run_ruler_refuses_empty_requests_up_front(tasks, kwargs, message):
    """No task, no sample or no answer token is a user error before any prompt is built (they returned an empty
    table, or scored every cell 0 as if the model had missed)."""
    with pytest.raises(EvalError, match=message):
        run_ruler(None, make_tokenizer(), tasks, [1024], generate=_never, max_position_embeddings=4096,
                  progress=False, log=None, **kwargs)


def test_one_prompt_per_batch_a_save_after_each_and_a_task_named_twice_runs_once():
    """`batch_tokens` under the length: batches of one prompt (not two); `save_every_s=0`: the result so far goes to
    `on_progress` after each batch, then at the task's end; a task named twice is one task (one row, its samples
    once)."""
    batches, saved = [], []

    def silent(prompts, n_new):
        batches.append(len(prompts))
        return [[] for _ in prompts]

    result = run_ruler(None, make_tokenizer(), ["vt", "vt"], [1536], samples=3, generate=silent, batch_tokens=1000,
                       max_position_embeddings=4096, save_every_s=0.0,
                       on_progress=lambda r: saved.append(len(r.cells)), progress=False, log=None)
    assert batches == [1, 1, 1]
    assert saved == [1, 2, 3, 3]
    assert result.tasks == ["vt"] and len(result.cells) == 3 and result.table().count("| vt |") == 1


def test_a_batch_out_of_memory_runs_again_one_prompt_at_a_time():
    """A batch of two that runs out of device memory runs as two batches of one: both prompts get their outputs
    (oracle: the same generator's answer for each prompt alone)."""
    import torch

    calls = []

    def small_only(prompts, n_new):
        calls.append(len(prompts))
        if len(prompts) > 1:
            raise torch.OutOfMemoryError("injected")
        return [[5] for _ in prompts]

    tok = make_tokenizer()
    result = run_ruler(None, tok, ["vt"], [1536], samples=2, generate=small_only, max_position_embeddings=4096,
                       progress=False, log=None)
    assert calls == [2, 1, 1]
    assert [c["output"] for c in result.cells] == [tok.decode([5], skip_special_tokens=True)] * 2


def test_a_generator_without_ragged_gets_rows_of_one_length_per_call(toy_tokenizer):
    """cwe's prompts differ in length by sample: a generator that does not declare `ragged` gets each length in
    its own call (a [B, L] tensor needs equal rows), every prompt once."""
    calls = []

    def equal_rows(prompts, n_new):
        calls.append({len(p) for p in prompts})
        return [[] for _ in prompts]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)  # a BPE: cwe's word lists take different token counts
    result = run_ruler(None, tok, ["cwe"], [1536], samples=3, generate=equal_rows,
                       max_position_embeddings=4096, progress=False, log=None)
    assert len({c["prompt_tokens"] for c in result.cells}) > 1  # the case is there: lengths differ
    assert all(len(lengths) == 1 for lengths in calls) and len(result.cells) == 3


def test_resume_runs_again_the_prompts_that_ran_out_of_memory():
    """Cells recorded as not run (out of memory, score None) are not kept by `previous`: the resumed run runs them."""
    import torch

    def out_of_memory(prompts, n_new):
        raise torch.OutOfMemoryError("injected")

    calls = []

    def fine(prompts, n_new):
        calls.append(len(prompts))
        return [[5] for _ in prompts]

    tok = make_tokenizer()
    common = dict(samples=2, max_position_embeddings=4096, progress=False, log=None)
    with pytest.warns(UserWarning, match="ran out of memory even alone"):
        earlier = run_ruler(None, tok, ["vt"], [1536], generate=out_of_memory, **common)
    assert [c["score"] for c in earlier.cells] == [None, None]
    again = run_ruler(None, tok, ["vt"], [1536], generate=fine, previous=earlier, **common)
    assert sum(calls) == 2 and all(c["score"] is not None for c in again.cells)


def test_a_lengths_average_is_over_every_task_scored_there():
    """The average row: the mean over the tasks scored at that length (a task not run there is left out)."""
    from megatron_ext.evaluate.ruler import RulerResult

    result = RulerResult(["vt", "cwe", "qa_1"], [1024, 2048], {"vt": [1.0, 0.5], "cwe": [0.0, None],
                                                                  "qa_1": [0.5, 0.0]})
    assert result.averages() == [0.5, 0.25]
    assert result.table().splitlines()[-1] == "| **average** | 50.0 | 25.0 |"


def test_a_haystack_file_shorter_than_the_checks_first_size_is_enough_for_short_lengths(tmp_path):
    """check_lengths builds its haystacks at 4,096 tokens or more (grown geometrically); a --haystack file of fewer
    tokens than that but enough for the lengths asked for is accepted (it was refused as too short)."""
    import itertools

    from megatron_ext.evaluate.haystack import filler_sentences
    from megatron_ext.evaluate.ruler import check_lengths

    tok = make_tokenizer()
    text = " ".join(itertools.islice(filler_sentences(5), 250))
    path = tmp_path / "essays.txt"
    path.write_text(text, encoding="utf-8")
    assert 1536 < len(tok(text, add_special_tokens=False)["input_ids"]) < 4096  # the case is there
    check_lengths(tok, ["niah_single_2"], [1536], haystack=path)  # no error (niah_single_2: the filler)
