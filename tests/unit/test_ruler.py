"""RULER-style tasks (megatron_ext.evaluate.ruler_tasks, ruler): prompts, answers, scoring, the runner, the CLI.

Outside oracle for the prompts: a reader written here that sees only the decoded prompt text and solves each task by
its rule (look the asked keys up among all needle sentences; follow VAR chains; count words). It must score 100% on
every task, length and seed: each prompt holds its answer and no other answer. Negative controls: the same reader
with one rule broken (the first needle instead of the asked key's, direct assignments only, the first words instead
of the most frequent) must score less, so the tasks tell a reader that follows the rule from one that does not.
"""

from __future__ import annotations

import json
import itertools
import random
import re
from collections import Counter

import pytest
import torch

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate import ruler_tasks
from megatron_ext.evaluate.ruler import RulerResult, _haystacks, run_ruler
from megatron_ext.evaluate.ruler_tasks import TASKS, SampleBuilder, match_all, pseudo_words, task_names, zipf_counts

LENGTHS = [1536, 4096, 12000]


@pytest.fixture(scope="module")
def tok(toy_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_tokenizer)


def run_haystacks(tok, n: int, seed: int = 0) -> dict:
    """The filler and noise haystacks as run_ruler makes them (each starts with a space)."""
    return _haystacks(tok, {"filler", "noise"}, None, n, seed)


@pytest.fixture(scope="module")
def builder(tok):
    return SampleBuilder(tok, run_haystacks(tok, max(LENGTHS)))


def read_answer(text: str, broken: bool = False) -> str:
    """Solve a prompt from its text alone; `broken`: with one rule of the task left out (the negative control)."""
    # vt and cwe prompts start with a solved example, which repeats the instruction: the task is from its last copy
    text = text[text.rindex(text.split("\n\n", 1)[0]):]
    body, question = text.rsplit("\n\n", 1)
    if "secret" in question:
        names = re.search(r"secret (?:number|code)s? of (.+?) in the text above", question).group(1)
        asked = re.split(r", | and ", names)
        needles = re.findall(r"The secret (?:number|code) of ([\w-]+) is ([\w-]+)\.", body)
        if broken:  # the first needle sentence, whoever's it is
            return needles[0][1]
        return ", ".join(v for key in asked for k, v in needles if k == key)
    if "VAR" in body:
        value = re.search(r"hold the value (\d+)", question).group(1)
        holds = {a: b for a, b in re.findall(r"VAR (\w+) = ([\w ]+?)\.", body)}
        found = {k for k, v in holds.items() if v == value}
        while not broken and (more := {k for k, v in holds.items() if v.startswith("VAR ") and v[4:] in found} - found):
            found |= more
        return ", ".join(sorted(found))
    if "numbered list" in body:
        words, top = re.findall(r"\d+\. (\w+)", body), 10
    else:
        words, top = re.findall(r"[a-z]+", body.split("\n\n", 1)[1].removeprefix("Text:")), 3
    if broken:  # the first distinct words of the list
        return ", ".join(list(dict.fromkeys(words))[:top])
    ranked = Counter(words).most_common(top + 1)
    assert ranked[top - 1][1] > ranked[top][1], "the most frequent words tie: the task has no single answer"
    return ", ".join(w for w, _ in ranked[:top])


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", list(TASKS))
def test_every_prompt_holds_its_answer_and_no_other(tok, builder, name, length):
    task, exact = TASKS[name], TASKS[name].kind in ("niah", "variable_tracking") and TASKS[name].haystack != "needles"
    for sample_no in range(3):
        sample = builder.build(task, length, random.Random(f"7:{name}:{length}:{sample_no}"))
        assert len(sample.ids) == length if exact else 0.97 * length <= len(sample.ids) <= length
        text = tok.decode(sample.ids, skip_special_tokens=True)
        assert match_all(read_answer(text), sample.answers) == 1.0, (name, length, sample_no)
        # and no other: the reader finds exactly the expected strings (a distractor with an asked key would add one)
        assert sorted(read_answer(text).split(", ")) == sorted(sample.answers), (name, length, sample_no)
        for at in sample.needle_tokens:  # recorded needle positions are where the needle sentences start
            assert re.match(r" ?(The secret|VAR )", tok.decode(sample.ids[at:at + 8])), at
        needles = task.keys - task.queries + task.queries * task.values  # distractors + the asked keys' values
        assert len(sample.needle_tokens) == {"niah": needles, "variable_tracking": 5}.get(task.kind, 0)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name, label, first", [("cwe", "List:", r" 1\. [a-z]+ 2\. "), ("fwe", "Text:", r" [a-z.]+ ")])
def test_a_word_list_follows_its_label_and_one_space(tok, name, label, first, chat):
    """The cwe and fwe lists are put together from " word" tokens; they read "others.\n\n 1. word" (a blank line,
    then a stray space) until they followed "List:" / "Text:" as the retrieval haystacks follow "Text:". Also in the
    solved cwe example, which repeats the instruction, and in the chat form."""
    builder = SampleBuilder(tok, run_haystacks(tok, 4096), chat=chat)
    for length in (1536, 4096):
        sample = builder.build(TASKS[name], length, random.Random(f"list:{name}:{length}"))
        text = tok.decode(sample.ids, skip_special_tokens=True)
        assert "\n " not in text, (name, length, text[:300])
        starts = [m.end() for m in re.finditer(re.escape(label), text)]
        assert len(starts) == (2 if sample.details.get("solved_example") else 1), (name, length)
        for at in starts:
            assert re.match(first, text[at:]), text[at - 40:at + 40]


class PlacedRandom(random.Random):
    """A sample's RNG that puts its needles at the first, the middle or the last of the places it draws from (the
    one draw of a list: `_in_haystack`'s of sentence starts); every other draw as random.Random."""

    def __init__(self, seed, where: str):
        super().__init__(seed)
        self.where = where

    def sample(self, population, k, **kwargs):
        if not isinstance(population, list):
            return super().sample(population, k, **kwargs)
        i = {"first": 0, "middle": (len(population) - k) // 2, "last": len(population) - k}[self.where]
        return population[i:i + k]


NEEDLE = re.compile(r"The secret (?:number|code) of [\w-]+ is [\w-]+\.|VAR \w+ = (?:VAR \w+|\d+)\.")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", [n for n, t in TASKS.items() if t.kind in ("niah", "variable_tracking")])
def test_every_needle_reads_alike_at_the_first_a_middle_and_the_last_place(tok, name, chat):
    """A needle reads after a full stop (or the instruction's "Text:") and a space, and is followed by a space and a
    word (or, in a body of needles only, the question). At the first place it read "about them.\n\n The secret ...
    is 4817263.Nobody" (a stray space, the first sentence glued to it); at the last, where the cut left only the
    space before a sentence, it was followed by " \n\nWhat". Every length from 1500 to 1547 (a cut after every
    token of a few sentences), the needles at the first, a middle and the last places; prompts of exactly the
    length. Control: on the older prompts the first place fails (and, alone, the last place's cut)."""
    from tests.unit.test_evaluate import CHAT_TEMPLATE

    task = TASKS[name]
    tok.chat_template = CHAT_TEMPLATE if chat else None
    try:
        build = SampleBuilder(tok, run_haystacks(tok, 1600), chat=chat).build
        for length, where in itertools.product(range(1500, 1548), ["first", "middle", "last"]):
            sample = build(task, length, PlacedRandom(f"{name}:{length}", where))
            assert len(sample.ids) == length or task.haystack == "needles"
            text = tok.decode(sample.ids, skip_special_tokens=True)
            start = text.rindex(text.split("\n\n", 1)[0].split("\n")[-1])  # vt's real task: after its example
            body = text[start:text.rindex("\n\n")]
            found = list(NEEDLE.finditer(text, start, start + len(body)))
            assert len(found) >= len(sample.needle_tokens) >= 1
            if task.haystack != "needles":  # the needles put in, found where recorded
                assert [len(tok.decode(sample.ids[:at], skip_special_tokens=True)) + 1 for at in sample.needle_tokens
                        ] == [m.start() for m in found]
            for m in found:
                before, after = text[m.start() - 6:m.start()], text[m.end():m.end() + 6]
                assert re.search(r"(\.|Text:) $", before), (length, where, before, m.group(0), after)
                assert re.match(r" [A-Z]", after) or (task.haystack == "needles" and m.end() == start + len(body)), \
                    (length, where, before, m.group(0), after)
    finally:
        tok.chat_template = None


@pytest.mark.parametrize("name", ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue",
                                  "vt", "cwe"])
def test_a_reader_that_breaks_the_rule_scores_less(tok, builder, name):
    scores = []
    for sample_no in range(6):
        length = 12000 if name == "cwe" else 4096  # at 4K this tokenizer fits few rare words: the first are common
        sample = builder.build(TASKS[name], length, random.Random(f"3:{name}:{sample_no}"))
        scores.append(match_all(read_answer(tok.decode(sample.ids, skip_special_tokens=True), broken=True),
                                sample.answers))
    assert sum(scores) / len(scores) < 0.6, scores


def test_fwe_answers_are_the_three_most_frequent_words_after_the_dots(tok, builder):
    """As RULER: the most frequent item is the noise token '...' (Zipf(2): ~61% of the text), which the question says
    to ignore; the answer is the next three, the most frequent coded words. Controls: counting the dots as a word, or
    taking ranks 3-5 of the words, is not the answer."""
    for sample_no in range(4):
        sample = builder.build(TASKS["fwe"], 4096, random.Random(f"5:{sample_no}"))
        text = tok.decode(sample.ids, skip_special_tokens=True)
        body = text.rsplit("\n\n", 1)[0].split("\n\n", 1)[1]
        assert "Ignore the dots '...'" in text and Counter(body.split()).most_common(1)[0][0] == "..."
        ranked = [w for w, _ in Counter(re.findall(r"[a-z]+", body)).most_common(4)]
        assert sample.answers == ranked[:3]
        assert match_all(", ".join(ranked[1:]), sample.answers) < 1
        assert match_all(", ".join(["...", *ranked[:2]]), sample.answers) < 1


def test_prompts_are_deterministic_and_differ_by_sample(builder):
    a = builder.build(TASKS["niah_multikey_1"], 2048, random.Random("0:a"))
    b = builder.build(TASKS["niah_multikey_1"], 2048, random.Random("0:a"))
    c = builder.build(TASKS["niah_multikey_1"], 2048, random.Random("0:b"))
    assert a.ids == b.ids and a.answers == b.answers and a.ids != c.ids


def test_chat_prompts_use_the_template(tok):
    from tests.unit.test_evaluate import CHAT_TEMPLATE

    tok.chat_template = CHAT_TEMPLATE
    try:
        chat = SampleBuilder(tok, run_haystacks(tok, 2048), chat=True)
        text = tok.decode(chat.build(TASKS["niah_single_2"], 2048, random.Random(0)).ids)
    finally:
        tok.chat_template = None
    assert text.startswith("<s>[user]\nSecret numbers") and "\n[assistant]\nThe secret number of" in text


def test_the_fast_encoding_path_is_the_tokenizers_own(tok):
    """SampleBuilder.enc goes straight to the Rust tokenizer; it must give what the transformers call gives."""
    from tests.unit.test_evaluate import make_tokenizer

    texts = [" 1.", " 12345.", " bolami", " The secret number of bolami-tuveko is 4817263.", "\n\nWhat is it?"]
    for tokenizer in (tok, make_tokenizer()):
        assert SampleBuilder(tokenizer, {}).enc(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]


def test_scoring_pieces():
    assert match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert match_all("ABC", ["abc"]) == 1.0
    assert zipf_counts(36, 2.0) == [36, 9, 4, 2, 1, 1]
    words = pseudo_words(random.Random(0), 500)
    assert len(set(words)) == 500 and all(re.fullmatch(r"([bdfghjklmnprstvwz][aeiou]){3}", w) for w in words)
    # every word is taken: an error, not an endless search
    every = {"".join(c) for c in itertools.product(*[[a + b for a in "bdfghjklmnprstvwz" for b in "aeiou"]] * 3)}
    assert pseudo_words(random.Random(0), 1, set(list(every)[1:]))  # the last free word is found
    with pytest.raises(EvalError, match="1 more distinct words asked with 614125 taken, of the 614125"):
        pseudo_words(random.Random(0), 1, every)
    assert task_names("vt,niah") == [n for n in TASKS if n.startswith("niah_")] + ["vt"]
    assert task_names("all") == list(TASKS)
    with pytest.raises(EvalError, match="--tasks: qa_1 is not a task"):
        task_names("vt,qa_1")


@pytest.mark.parametrize("name,length,message", [
    ("niah_single_2", 40, "niah_single_2: length 40 is shorter than its prompt"),
    ("niah_multikey_2", 40, "niah_multikey_2: length 40 is too short"),
    ("cwe", 300, "cwe: length 300 is too short for its smallest list"),
    ("fwe", 150, "fwe: length 150 is too short for its smallest list"),
])
def test_lengths_too_short_are_user_errors(builder, name, length, message):
    with pytest.raises(EvalError, match=message):
        builder.build(TASKS[name], length, random.Random(0))


def test_cwe_lowers_the_common_count_only_when_it_must(builder):
    assert builder.build(TASKS["cwe"], 12000, random.Random(0)).details["common_word_count"] == 30
    assert 3 < builder.build(TASKS["cwe"], 1536, random.Random(0)).details["common_word_count"] < 30


def test_word_keys_outnumber_the_distinct_words(tok, monkeypatch):
    """niah_multikey_2 at 4M tokens holds about 260,000 needles, each with its own key, and there are 614,125 words:
    two fresh words a key ran out at 307,062 keys. Constructed case: 8 syllables (512 words, 256 such keys) and a
    12,000-token prompt of 342 needles. Keys are distinct word pairs, so it builds (with the old rule, EvalError)."""
    monkeypatch.setattr(ruler_tasks, "_CONSONANTS", "bdfg")
    monkeypatch.setattr(ruler_tasks, "_VOWELS", "ae")
    monkeypatch.setattr(ruler_tasks, "_WORDS", 8 ** 3)
    sample = SampleBuilder(tok, {}).build(TASKS["niah_multikey_2"], 12000, random.Random(0))
    text = tok.decode(sample.ids, skip_special_tokens=True)
    keys = re.findall(r"The secret number of ([a-z]+-[a-z]+) is", text.rsplit("\n\n", 1)[0])  # not the answer prefix
    assert len(keys) == len(set(keys)) > 256 and len({w for k in keys for w in k.split("-")}) <= 512
    assert match_all(read_answer(text), sample.answers) == 1.0


def oracle_generate(tok):
    """A `generate` that answers by `read_answer` (any lengths in one call)."""
    def generate(prompts, max_new_tokens):
        return [tok(" " + read_answer(tok.decode(p, skip_special_tokens=True)), add_special_tokens=False)["input_ids"]
                for p in prompts]
    generate.ragged = True
    return generate


def test_run_ruler_scores_the_reader_100_and_resumes(tok):
    tasks, saved = ["niah_single_1", "niah_multiquery", "vt", "cwe", "fwe"], []
    result = run_ruler(None, tok, tasks, [1536, 3000], samples=2, generate=oracle_generate(tok),
                       max_position_embeddings=4096, on_progress=saved.append, progress=False, log=None)
    assert result.accuracy == 1.0 and result.averages() == [1.0, 1.0] and len(result.cells) == 20
    assert len(saved) == 10 and len(saved[0].cells) == 2  # after each task and length
    assert "| **average** | 100.0 | 100.0 |" in result.table()
    again = RulerResult.from_dict(json.loads(json.dumps(result.to_dict())))
    calls = []

    def counting(prompts, n):
        calls.append(len(prompts))
        return oracle_generate(tok)(prompts, n)
    counting.ragged = True
    more = run_ruler(None, tok, tasks, [1536, 3000, 4000], samples=2, generate=counting, max_position_embeddings=4096,
                     previous=again, progress=False, log=None)
    assert sum(calls) == 10 and more.accuracy == 1.0  # only the new length ran
    assert [c for c in more.cells if c["length"] != 4000] == result.cells
    with pytest.raises(EvalError, match="max_new_tokens = None, this run has 5"):
        run_ruler(None, tok, tasks, [1536], samples=2, max_new_tokens=5, generate=counting,
                  max_position_embeddings=4096, previous=again, progress=False, log=None)
    older = json.loads(json.dumps(result.to_dict()))
    del older["settings"]["prompt_version"]  # results of the prompts before vt and cwe had their solved example
    with pytest.raises(EvalError, match="prompt_version = None, this run has 4"):
        run_ruler(None, tok, tasks, [1536, 3000], samples=2, generate=counting, max_position_embeddings=4096,
                  previous=RulerResult.from_dict(older), progress=False, log=None)


def test_results_of_the_older_prompt_form_are_not_extended(tok):
    """The needles' edges changed (prompt_version 3), the word lists' (4): results of the older prompts are refused,
    not extended."""
    common = dict(samples=1, generate=oracle_generate(tok), max_position_embeddings=4096, progress=False, log=None)
    earlier = run_ruler(None, tok, ["niah_single_2", "vt"], [1536], **common)
    assert earlier.settings["prompt_version"] == 4
    older = json.loads(json.dumps(earlier.to_dict()))
    older["settings"]["prompt_version"] = 3
    with pytest.raises(EvalError, match="made with prompt_version = 3, this run has 4: use another --out"):
        run_ruler(None, tok, ["niah_single_2", "vt"], [1536, 2048], previous=RulerResult.from_dict(older), **common)


@pytest.mark.parametrize("chunk", ["auto", None, 64])
def test_rows_of_different_lengths_decode_as_each_alone(chunk):
    """greedy_generate_rows (the HF engine's RULER batches): left padding and the attention mask give each row
    the continuation it gets alone, also when a prefill chunk is all padding for a short row, and EOS cuts a row."""
    from megatron_ext.evaluate.generate import greedy_generate, greedy_generate_rows
    from tests.unit.test_evaluate import make_model

    model = make_model()
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (50, 97, 200, 130)]
    alone = [greedy_generate(model, torch.tensor([r]), 8, prefill_chunk=None)[0] for r in rows]
    assert greedy_generate_rows(model, rows, 8, prefill_chunk=chunk) == alone
    eos = (alone[1][2],)
    cut = greedy_generate_rows(model, rows, 8, eos_token_ids=eos, prefill_chunk=chunk)
    assert cut[1] == alone[1][:alone[1].index(eos[0]) + 1]


def test_run_ruler_on_a_tiny_llama_with_transformers(tok):
    """The default generator: greedy decoding on an HF model, prompts of different lengths in one batch."""
    from megatron_ext.evaluate import greedy_generate
    from tests.unit.test_evaluate import make_model

    model = make_model()
    model.config.max_position_embeddings = 2048  # the preset's 256 (no effect on its llama3 RoPE)
    result = run_ruler(model, tok, ["niah_single_2", "cwe"], [1536], samples=3, max_new_tokens=4,
                       batch_tokens=3 * 1536, progress=False, log=None)
    for cell in (result.cells[0], result.cells[4]):  # niah_single_2 (exactly 1,536 tokens), cwe (the list that fits)
        again = greedy_generate(model, torch.tensor([_prompt(tok, cell["task"], 1536, cell["sample"])]), 4,
                                prefill_chunk=None)
        assert cell["output"] == tok.decode(again[0], skip_special_tokens=True)
    assert len({c["prompt_tokens"] for c in result.cells if c["task"] == "cwe"}) > 1  # one batch of 3 lengths
    assert all(0.0 <= c["score"] <= 1.0 and c["prompt_tokens"] <= 1536 for c in result.cells)
    assert result.settings["dtype"] == "float32" and result.settings["max_new_tokens"] == 4
    with pytest.warns(UserWarning, match="exceed the model's max_position_embeddings"):
        skipped = run_ruler(model, tok, ["vt"], [1536, 4096], samples=1, max_new_tokens=2, progress=False, log=None)
    assert skipped.skipped_lengths == [4096] and skipped.scores["vt"][1] is None


def _prompt(tok, name: str, length: int, sample: int, seed: int = 0) -> list[int]:
    rng = random.Random(f"{seed}:{name}:{length}:{sample}")
    return SampleBuilder(tok, run_haystacks(tok, length, seed)).build(TASKS[name], length, rng).ids


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "vt,qa"], "--tasks: qa is not a task"),
    (["--haystack", "/nonexistent.txt"], "--haystack /nonexistent.txt does not exist"),
    (["--cp", "2"], "belong to --engine megatron"),
    (["--lengths", "4K,x"], "--lengths: 'x' is not a token count"),
])
def test_cli_user_errors(tmp_path, capsys, argv, message):
    from megatron_ext.evaluate.cli import main

    with pytest.raises(SystemExit) as e:
        main(["ruler", "--model", str(tmp_path), "--out", str(tmp_path / "o"), *argv])
    assert message in str(e.value)


@pytest.mark.parametrize("own_tokenizer", [False, True])
def test_cli_finds_every_length_too_short_before_loading_the_model(tmp_path, toy_tokenizer, monkeypatch,
                                                                   own_tokenizer):
    """`ruler --tasks all --lengths 256,1K` failed on one task, after the model loaded; a retry at 512 failed on the
    next, after another load. Now one line before the load (a sentinel in place of the loader) names each task
    too short and the smallest length all of them take: every sample the run would build fits there."""
    from transformers import AutoTokenizer

    from megatron_ext.evaluate import loading
    from megatron_ext.evaluate.cli import main
    from tests.unit.test_evaluate import save_tiny

    def loader(*args, **kwargs):
        raise AssertionError("the model was loaded before the lengths were checked")

    monkeypatch.setattr(loading, "load_hf", loader)
    # --tokenizer with a model folder that is not there (only the tokenizer is read), or the model folder's own
    model = save_tiny(tmp_path / "hf") if own_tokenizer else tmp_path / "absent"
    source = ["--model", str(model)] + ([] if own_tokenizer else ["--tokenizer", toy_tokenizer])
    with pytest.raises(SystemExit) as e:
        main(["ruler", *source, "--tasks", "all", "--lengths", "256,1K", "--samples", "2", "--out",
              str(tmp_path / "o"), "--no-progress"])
    msg = str(e.value.code)
    assert "\n" not in msg and msg.startswith("error: --lengths 256: too short for "), msg
    m = re.search(r"the smallest length all selected tasks take is (\d+) \((\w+) needs the most\): use --lengths of "
                  r"at least \1$", msg)
    assert m, msg
    smallest, named = int(m.group(1)), dict(re.findall(r"(\w+) \(needs >= (\d+) tokens\)", msg))
    assert 256 < smallest < 1024 and int(named[m.group(2)]) == max(map(int, named.values())) <= smallest
    assert len(named) >= (1 if own_tokenizer else 5)  # the toy BPE tokenizer's prompts: 7 tasks over 256 tokens

    tok = AutoTokenizer.from_pretrained(model if own_tokenizer else toy_tokenizer)
    build = SampleBuilder(tok, run_haystacks(tok, 4096)).build

    def fits(name: str, n: int) -> bool:  # the prompts the run would build: samples 0 and 1, the run's seeds
        try:
            for s in range(2):
                build(TASKS[name], n, random.Random(f"0:{name}:{n}:{s}"))
        except EvalError:
            return False
        return True

    assert all(fits(t, smallest) for t in TASKS)
    assert not all(fits(t, smallest - 1) for t in TASKS)
    assert {t for t in TASKS if not fits(t, 256)} == set(named)
    assert not (tmp_path / "o").exists()


def test_the_launchers_evaluation_stage_reports_the_ruler_average(tmp_path):
    """launch_eval.EvalStage (what each task of `launch --ruler` runs) runs tools/niah.py ruler and returns the
    average it wrote to ruler.json."""
    from megatron_ext.launch_eval import EVALUATIONS, EvalStage
    from tests.unit.test_evaluate import save_tiny

    hf = save_tiny(tmp_path / "hf")
    ruler = {e.name: e for e in EVALUATIONS}["ruler"]
    argv = [*ruler.command, "--model", str(hf), "--tasks", "niah_single_1,vt", "--lengths", "200",
            "--samples", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "out"), "--no-progress"]
    got = EvalStage("ruler", argv, ruler.results)()
    written = json.loads((tmp_path / "out/ruler.json").read_text())
    assert got == {"stage": "ruler", "out": str(tmp_path / "out"), "accuracy": written["accuracy"]}
    assert len(written["cells"]) == 2


def test_resume_refuses_other_numerics(tok):
    """RULER's --resume compared the prompts' settings alone: cells of another dtype, engine or tokenizer were
    kept. Now refused in one line (older results without these settings are kept as before)."""
    from megatron_ext.evaluate.run_settings import tokenizer_digest

    def reader(prompts, n):
        return oracle_generate(tok)(prompts, n)
    reader.ragged = True
    common = dict(samples=1, generate=reader, max_position_embeddings=4096, progress=False, log=None)
    earlier = run_ruler(None, tok, ["vt"], [1536], numerics={"engine": "megatron", "dtype": "bf16"}, **common)
    assert earlier.settings["tokenizer_sha256"] == tokenizer_digest(tok)
    with pytest.raises(EvalError, match=r"^--resume: the earlier cells ran with dtype bf16, this run with fp32 "
                                        r"\(bf16 -> fp32\): resume with --dtype bf16, or use another --out$"):
        run_ruler(None, tok, ["vt"], [1536, 2048], numerics={"engine": "megatron", "dtype": "fp32"},
                  previous=earlier, **common)
    with pytest.raises(EvalError, match=r"ran with engine megatron, this run with hf"):
        run_ruler(None, tok, ["vt"], [1536, 2048], numerics={"engine": "hf", "dtype": "bfloat16"},
                  previous=earlier, **common)
    same = run_ruler(None, tok, ["vt"], [1536, 2048], numerics={"engine": "megatron", "dtype": "bf16"},
                     previous=earlier, **common)  # a layout or device change is no other numerics
    assert same.cells[0] == earlier.cells[0]
    older = json.loads(json.dumps(earlier.to_dict()))
    for key in ("engine", "tokenizer", "tokenizer_sha256"):
        del older["settings"][key]
    run_ruler(None, tok, ["vt"], [1536, 2048], numerics={"engine": "hf", "dtype": "bf16"},
              previous=RulerResult.from_dict(older), **common)


def test_word_list_is_the_largest_that_fits_exactly(tok):
    """`_fit_list` takes the largest list that fits, also when it fills the length to the last token (the bisection
    keeps a size equal to the budget). Oracle: the size of the first 50 words counted by hand."""
    words = pseudo_words(random.Random(3), 200)
    build = SampleBuilder(tok, {})
    word_tokens = [len(ids) for ids in build.enc([" " + w for w in words])]
    period = len(build.enc(["."])[0])
    length = 2 + sum(word_tokens[:50]) + period * (50 // 12)  # head, tail, 50 words, a period after every 12th
    sample = build._fit_list("t", length, random.Random(0), [1], [2], lambda n: [(w, 1) for w in words[:n]], [],
                             lo=2, numbered=False)
    assert len(sample.ids) == length
    assert sorted(tok.decode(sample.ids[1:-1]).replace(".", " ").split()) == sorted(words[:50])
