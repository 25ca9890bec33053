"""Long-context evaluation (megatron_ext.evaluate): NIAH prompts, scoring, decoding, perplexity by position, plots.

The model is a tiny random-initialised Llama-3.1-shaped `LlamaForCausalLM` (the TINY preset) saved
with save_pretrained, and the tokenizer a word-level one built here that covers every word NIAH
writes. Results are meaningless with random weights; the plumbing is what these tests check.
Outside oracles: transformers' own `generate` and loss.
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext.evaluate import (EvalError, NeedleTask, builtin_haystack, build_prompt, extract_value,
                                   file_haystack, greedy_generate, indexed_documents, kv_cache_bytes_per_token,
                                   load_hf, log_buckets,
                                   memory_note, perplexity_by_position, plot_niah_heatmap, plot_perplexity, run_niah,
                                   score_output, write_json_atomic)
from megatron_ext.evaluate.haystack import filler_words
from megatron_ext.evaluate.niah import prompt_parts
from megatron_ext.evaluate.perplexity import token_losses
from megatron_ext.presets import LLAMA31_8B, TINY

CHAT_TEMPLATE = ("<s>{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]\n{% endif %}")


def make_tokenizer():
    """PreTrainedTokenizerFast: WordLevel over NIAH's words, digits one by one, lossless decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = NeedleTask()
    text = t.instruction + t.needle + t.question + t.answer_prefix + " user assistant [ ]"
    words = set(filler_words()) | set(re.findall(r"[A-Za-z]+|[^\sA-Za-z0-9{}]", text))
    vocab = ["<unk>", "<s>", "</s>", "\u2581", "\n"] + [str(i) for i in range(10)]
    for w in sorted(words):
        vocab += [w, "\u2581" + w]
    vocab = list(dict.fromkeys(vocab))
    assert len(vocab) <= TINY["vocab_size"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation(),
    ])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_model():
    """Random-initialised LlamaForCausalLM of the TINY preset (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    return LlamaForCausalLM(cfg).eval()


def save_tiny(path: Path) -> Path:
    """Save the tiny model and tokenizer as an HF directory; returns it."""
    make_model().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is several times faster (no spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """(model, tokenizer) loaded back from the saved directory, as tools/niah.py does."""
    return load_hf(tiny_dir, device="cpu")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def assert_png(path: Path) -> tuple[int, int]:
    """A complete, non-empty PNG: signature, IHDR size, IEND chunk, and Pillow can decode it."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert data.endswith(b"IEND\xaeB`\x82")  # complete: ends with the IEND chunk and its CRC
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        assert im.size == (width, height)
        assert len(set(im.convert("RGB").getdata())) > 10  # drawn, not blank
    return width, height


def find_sub(seq: list[int], sub: list[int]) -> list[int]:
    """Start indices of `sub` in `seq`."""
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]


# ---------------------------------------------------------------------------------------------- pure functions


def test_kv_cache_bytes_from_config():
    # 2 x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB per token for Llama-3.1-8B in bf16.
    assert kv_cache_bytes_per_token(LLAMA31_8B, 2) == 131072
    assert kv_cache_bytes_per_token(TINY, 4) == 2 * 2 * 2 * 16 * 4
    note = memory_note(LLAMA31_8B, 1 << 20, 1, 2, n_params=8_030_261_248, free_bytes=140 << 30)
    assert "128.0 KiB/token" in note and "128.0 GiB" in note and "NOT fit" in note  # 128 + 15 GiB > 140 GiB
    assert "--engine megatron" in note  # the way to evaluate it anyway
    assert "NOT fit" not in memory_note(LLAMA31_8B, 1 << 19, 1, 2, n_params=8_030_261_248, free_bytes=140 << 30)
    # a chunked prefill (beyond 32K tokens) repeats the 8 KV heads to 32 for SDPA with its mask: 2 x 32 x 128 x 2 B
    # = 16 KiB per token, plus the [chunk, length] boolean mask (1024 x 896K); 112 + 15 GiB alone would fit 140 GiB
    note = memory_note(LLAMA31_8B, 7 << 17, 1, 2, n_params=8_030_261_248, free_bytes=140 << 30)
    assert "+ up to 14.9 GiB while a layer runs a prefill chunk (its mask, keys and values repeated to 32 heads)" in \
        note and "NOT fit" in note, note
    assert "prefill chunk" not in memory_note(LLAMA31_8B, 32768, 1, 2)  # one pass: no mask, SDPA does the GQA


def test_auto_prefill_chunk():
    from megatron_ext.evaluate.generate import auto_prefill_chunk

    assert auto_prefill_chunk(1000) == 1000 and auto_prefill_chunk(32768) == 32768  # one pass: SDPA is_causal
    assert auto_prefill_chunk(65536) == 8192  # capped
    assert auto_prefill_chunk(1 << 20) == 1024  # [1024, 1M] bool mask = 1 GiB
    assert auto_prefill_chunk(1 << 20, batch=2) == 512
    assert auto_prefill_chunk(1 << 22) == 256
    assert auto_prefill_chunk(3_000_000) == 256  # floor


def test_log_buckets_exact_and_cover_every_position():
    assert log_buckets(10, 1) == [(1, 2), (2, 4), (4, 8), (8, 10)]
    assert log_buckets(10, 2) == [(1, 2), (2, 3), (3, 4), (4, 6), (6, 8), (8, 10)]
    assert log_buckets(2) == [(1, 2)]
    for n in [2, 3, 17, 256, 1000, 1 << 20]:
        for per in (1, 2, 4):
            b = log_buckets(n, per)
            assert b[0][0] == 1 and b[-1][1] == n
            assert all(s < e for s, e in b) and all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    assert len(log_buckets(1 << 22, 1)) == 22  # 4M positions: one bucket per doubling
    with pytest.raises(EvalError, match="at least 2 tokens"):
        log_buckets(1)


def test_scoring_is_exact_match_on_the_value():
    v = "4817263"
    assert score_output(v, v) == 1.0
    assert score_output(" 4817263.\nThe end", v) == 1.0
    assert extract_value("The number is 4817263 indeed") == v
    for wrong in ["48172630", "481726", "4817264", "no number here", "", "1 4817263"]:
        assert score_output(wrong, v) == 0.0, wrong  # superstring, prefix, off by one, none, first number wrong


# ---------------------------------------------------------------------------------------------- haystack and prompt


def test_builtin_filler_is_deterministic_and_starts_are_sentence_starts(tok):
    a, b = builtin_haystack(tok, 3000, seed=3), builtin_haystack(tok, 3000, seed=3)
    assert len(a) >= 3000 and np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)
    assert not np.array_equal(builtin_haystack(tok, 3000, seed=4).ids[:200], a.ids[:200])
    assert tok.unk_token_id not in a.ids  # the test vocabulary covers the filler
    # Every recorded start is a capitalised word right after a full stop; no sentence start is missed.
    toks = tok.convert_ids_to_tokens(a.ids.tolist())
    starts = set(a.starts.tolist())
    for i in range(1, len(toks)):
        assert (i in starts) == (toks[i - 1] == "."), (i, toks[i - 1:i + 1])
    assert 0 in starts


def test_builtin_haystack_with_a_byte_level_bpe_tokenizer():
    """Sentence starts found from offsets also with Llama-3-like byte-level BPE (spaces glued to words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.evaluate.haystack import filler_sentences

    gen = filler_sentences(0)
    corpus = [" ".join(next(gen) for _ in range(50)) for _ in range(20)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk = PreTrainedTokenizerFast(tokenizer_object=bpe)
    hay = builtin_haystack(tk, 2000)
    text_starts = [tk.decode(hay.ids[s:s + 2].tolist()) for s in hay.starts[1:50]]
    assert all(re.match(r" [A-Z]", t) for t in text_starts), text_starts
    n_sentences = tk.decode(hay.ids.tolist()).count(".")
    assert abs(len(hay.starts) - n_sentences) <= 1


@pytest.mark.parametrize("length", [100, 177, 256, 1000])
def test_prompt_has_exact_length_and_needle_at_depth(tok, length):
    task = NeedleTask()
    head, tail = prompt_parts(tok, task, chat=False)
    assert head[0] == tok.bos_token_id
    needle = tok(task.needle.format(value="4817263"), add_special_tokens=False)["input_ids"]
    hay = builtin_haystack(tok, length, lead=" ")
    longest_sentence = int(np.diff(hay.starts).max())
    starts = set(hay.starts.tolist())
    for depth in range(0, 101, 10):
        ids, pos, n_hay = build_prompt(hay, head, needle, tail, length, depth)
        assert len(ids) == length  # token-exact
        assert ids[:len(head)] == head and ids[-len(tail):] == tail
        assert find_sub(ids, needle) == [pos]  # the needle once, where reported
        at = pos - len(head)
        # the nearest sentence start; at 100% the last one before the cut, which is mid-sentence unless one starts
        # there (a needle after the cut followed half a sentence)
        assert abs(at - depth / 100 * n_hay) <= (longest_sentence if depth == 100 else longest_sentence / 2 + 1)
        assert at in starts  # between sentences, never inside one (nor after the cut)
        # Without the needle the middle is exactly the first n_hay haystack tokens.
        assert ids[len(head):pos] + ids[pos + len(needle):-len(tail)] == hay.ids[:n_hay].tolist()
        if depth == 0:
            assert at == 0
        if depth == 100:
            assert at == max(s for s in starts if s <= n_hay)
    with pytest.raises(EvalError, match="at least"):
        build_prompt(hay, head, needle, tail, len(head) + len(tail), 50)


@pytest.mark.parametrize("chat", [False, True])
def test_the_needle_reads_alike_at_every_depth(tok, tmp_path, chat):
    """At depth 0 the needle read "remember it.\\n\\n The special ... 4817263.Nobody" (a stray space, the next
    sentence glued to it), at 100% it followed a sentence cut mid-way; elsewhere ". The special ... 4817263. Every".
    Now every depth of run_niah's prompts reads the needle after a full stop (or "Text:") and before a space and a
    sentence; a file haystack too."""
    tk = make_tokenizer()
    tk.chat_template = CHAT_TEMPLATE
    # after a full stop or "Text:"; then a sentence, or the question where the haystack part ends with a sentence
    pattern = re.compile(r"(?:[a-z]\.|Text:) The special magic number is \d{7}\.(?: [A-Z]|\n\nWhat)")
    hay = tmp_path / "hay.txt"
    hay.write_text("The old river passes the garden near the hill. A farmer greets the teacher. " * 40)
    for haystack in (None, hay):
        reader = Recorder(tk, _read_needle)
        res = run_niah(None, tk, [100, 177, 256], range(0, 101, 10), haystack=haystack, chat=chat, generate=reader,
                       progress=False, log=None)
        assert res.accuracy == 1.0
        for row in (r for b in reader.batches for r in b.tolist()):
            text = tk.decode(row)
            assert len(pattern.findall(text)) == 1, text
    assert res.settings["prompt_version"] == 2


def test_chat_template_prompt_parts(tok):
    tk = make_tokenizer()
    tk.chat_template = CHAT_TEMPLATE
    task = NeedleTask()
    head, tail = prompt_parts(tk, task, chat=True)
    assert head[0] == tk.bos_token_id and head.count(tk.bos_token_id) == 1
    assert tk.decode(head).startswith("<s>[user]\nThere is a special magic number")
    assert tk.decode(tail).endswith("?\n[assistant]\nThe special magic number is")
    with pytest.raises(EvalError, match="chat template"):
        prompt_parts(tok, task, chat=True)


def test_haystack_file_too_short_says_by_how_much(tok, tmp_path):
    f = tmp_path / "essay.txt"
    f.write_text("The old river passes the garden. A farmer greets the teacher near the hill.\n" * 10)
    n = len(tok(f.read_text(), add_special_tokens=False)["input_ids"])
    hay = file_haystack(tok, f, n)
    assert len(hay) == n and len(hay.starts) == 1 + 20  # token 0, then after each of the 20 full stops
    with pytest.raises(EvalError, match=f"has {n:,} tokens .* needs 5,000 haystack tokens \\(short by {5000 - n:,}\\)"):
        file_haystack(tok, f, 5000)
    with pytest.raises(EvalError, match="does not exist"):
        file_haystack(tok, tmp_path / "missing.txt", 10)


def test_megatron_paths_that_are_not_checkpoints(tmp_path):
    """--megatron given a file or an HF model folder: said before the converter runs (it advised converting the HF
    folder to HF)."""
    from megatron_ext.evaluate.loading import convert_megatron

    f = tmp_path / "a.txt"
    f.write_text("x")
    with pytest.raises(EvalError, match=r"--megatron .*a\.txt is a file, not a Megatron checkpoint folder"):
        convert_megatron(f, tmp_path / "out")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text("{}")
    with pytest.raises(EvalError, match=r"--megatron .*hf is a Hugging Face model folder .*: pass --model .*hf$"):
        convert_megatron(tmp_path / "hf", tmp_path / "out")


# ---------------------------------------------------------------------------------------------- NIAH grid


class Recorder:
    """A generate callable: records the prompts it gets and answers with `answer(prompt_text)`."""

    def __init__(self, tok, answer):
        self.tok, self.answer, self.batches = tok, answer, []

    def __call__(self, ids: torch.Tensor) -> list[list[int]]:
        self.batches.append(ids.clone())
        return [self.tok(self.answer(self.tok.decode(row)), add_special_tokens=False)["input_ids"] for row in ids.tolist()]


def _read_needle(prompt: str) -> str:
    """What a perfect retriever answers: the value after 'magic number is' in the prompt."""
    return " " + re.search(r"special magic number is (\d+)\.", prompt).group(1) + "."


def test_reader_stub_scores_100_and_constant_scores_0(tok):
    lengths, depths = [80, 150, 256], [0, 25, 50, 75, 100]
    reader = Recorder(tok, _read_needle)
    res = run_niah(None, tok, lengths, depths, samples=2, batch_tokens=700, generate=reader, progress=False, log=None)
    assert np.array(res.scores).shape == (len(depths), len(lengths))  # [depth, length]
    assert res.accuracy == 1.0 and len(res.cells) == len(lengths) * len(depths) * 2
    assert len({c["value"] for c in res.cells}) == len(res.cells)  # a fresh random value per prompt
    # Batches: one length each, no padding, at most batch_tokens // length rows.
    rows = {n: 0 for n in lengths}
    for b in reader.batches:
        n = b.shape[1]
        assert b.shape[0] <= max(1, 700 // n)
        rows[n] += b.shape[0]
    assert rows == {n: len(depths) * 2 for n in lengths}
    # The reported needle position is where the needle is in the prompt the model saw (prompts run by depth,
    # shallow to deep and back by turns from length to length, not in the order of the cells).
    prompts = [row for b in reader.batches for row in b.tolist()]
    assert [len(p) for p in prompts] == [n for n in lengths for _ in range(len(depths) * 2)]
    for c in res.cells:
        needle = tok(NeedleTask().needle.format(value=c["value"]), add_special_tokens=False)["input_ids"]
        (p,) = [p for p in prompts if find_sub(p, needle)]
        assert find_sub(p, needle) == [c["needle_token"]]
        assert abs(c["actual_depth"] - c["depth"]) <= 100 * 12 / c["haystack_tokens"] + 1e-9  # within a sentence
    constant = run_niah(None, tok, lengths, depths, generate=Recorder(tok, lambda _: " 1234567."),
                        progress=False, log=None)
    assert constant.accuracy == 0.0 and all(s == 0.0 for row in constant.scores for s in row)
    def last_digit_wrong(prompt: str) -> str:
        v = _read_needle(prompt).strip(" .")
        return f" {v[:-1]}{(int(v[-1]) + 1) % 10}."

    off_by_one = run_niah(None, tok, [150], [0, 50, 100], generate=Recorder(tok, last_digit_wrong),
                          progress=False, log=None)
    assert off_by_one.accuracy == 0.0


def test_out_of_memory_batches_are_halved_then_recorded_as_not_run(tok, tmp_path):
    """A batch that runs out of memory is retried in halves; a single prompt that does is a grey cell."""
    reader = Recorder(tok, _read_needle)

    def gen(ids):
        if ids.shape[0] > 2 or ids.shape[1] == 256:
            raise torch.OutOfMemoryError("CUDA out of memory (stub)")
        return reader(ids)

    partial = []
    with pytest.warns(UserWarning, match="out of memory even as a batch of 1") as rec:
        res = run_niah(None, tok, [100, 256], [0, 50, 100], samples=2, batch_tokens=10_000, generate=gen,
                       on_progress=partial.append, progress=False, log=None)
    assert sum("out of memory" in str(w.message) for w in rec) == 6  # one per prompt that never ran
    assert str(rec[0].message).startswith("length 256, depth 100%: out of memory")  # the 2nd length runs deep first
    assert [b.shape[0] for b in reader.batches] == [1, 2, 1, 2]  # 6 rows: 6 -> 3 + 3 -> (1 + 2) + (1 + 2)
    assert [row[0] for row in res.scores] == [1.0, 1.0, 1.0] and [row[1] for row in res.scores] == [None] * 3
    assert sum(c.get("error") == "out of memory" for c in res.cells) == 6 and res.accuracy == 1.0
    assert [p.scores[0] for p in partial] == [[1.0, None], [1.0, None]]  # saved after each length
    assert len(partial[0].cells) == 6 and len(partial[1].cells) == 12
    assert_png(plot_niah_heatmap(res, tmp_path / "h.png"))


def test_run_niah_real_model_grid_results_and_heatmap(tiny, tmp_path):
    model, tok = tiny
    with pytest.warns(UserWarning, match=r"lengths \[512\] exceed the model's max_position_embeddings=256"):
        res = run_niah(model, tok, [64, 128, 256, 512], [0, 50, 100], batch_tokens=300, prefill_chunk=48,
                       max_new_tokens=6, progress=False, log=None)
    assert res.skipped_lengths == [512]
    assert [row[3] for row in res.scores] == [None, None, None]
    assert all(s in (0.0, 1.0) for row in res.scores for s in row[:3])
    assert all(len(tok(c["output"], add_special_tokens=False)["input_ids"]) <= 6 + 1 for c in res.cells)
    assert res.settings["device"] == "cpu" and res.settings["dtype"] == "float32"
    js = write_json_atomic(tmp_path / "results.json", res.to_dict())
    loaded = json.loads(js.read_text())
    assert loaded["lengths"] == [64, 128, 256, 512] and len(loaded["cells"]) == 9
    w, h = assert_png(plot_niah_heatmap(loaded, tmp_path / "heatmap.png"))
    assert w > h  # landscape: lengths across, depths down
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heatmap.png", "results.json"]  # no temp files left
    # Forced: the too-long length runs (negative control of the skip).
    with pytest.warns(UserWarning, match="forced"):
        forced = run_niah(model, tok, [512], [50], allow_beyond_max_positions=True, max_new_tokens=2,
                          progress=False, log=None)
    assert forced.skipped_lengths == [] and forced.scores[0][0] is not None
    with pytest.raises(EvalError, match="every length"), pytest.warns(UserWarning, match="skipping"):
        run_niah(model, tok, [1024], [50], progress=False, log=None)
    with pytest.raises(EvalError, match="0..100"):
        run_niah(model, tok, [64], [-5, 50], progress=False, log=None)
    with pytest.raises(EvalError, match="shorter than the prompt"):
        run_niah(model, tok, [20, 64], [50], progress=False, log=None)


# ---------------------------------------------------------------------------------------------- decoding and loss vs transformers


def test_greedy_generate_matches_transformers_generate(tiny):
    model, _ = tiny
    ids = torch.randint(5, TINY["vocab_size"], (3, 41), generator=torch.Generator().manual_seed(1))
    model.generation_config.eos_token_id = None
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                         min_new_tokens=10, pad_token_id=0)[:, ids.shape[1]:].tolist()
    for chunk in (None, 7, 41, 1000):
        assert greedy_generate(model, ids, 10, prefill_chunk=chunk) == ref
    # EOS handling: stop a row at the first EOS, EOS kept.
    first = ref[0][3]
    out = greedy_generate(model, ids[:1], 10, eos_token_ids=(first,))
    assert out == [ref[0][:ref[0].index(first) + 1]]


@pytest.mark.parametrize("chunk", [16, None])
def test_shared_prefix_greedy_matches_transformers_generate(tiny, chunk):
    """Prompts starting like the one before run only their rest through the kept cache (cropped to the shared
    prefix); each continuation equals transformers' `generate` on the whole prompt. Batches and short shared
    prefixes run whole."""
    from megatron_ext.evaluate.generate import SharedPrefixGreedy

    model, _ = tiny
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(2)
    base = torch.randint(5, TINY["vocab_size"], (60,), generator=g).tolist()
    prompts = [base, base[:30] + torch.randint(5, TINY["vocab_size"], (25,), generator=g).tolist(),
               base[:30] + [7] * 30, base[:3] + [9] * 50, [9] + base[1:]]
    shared = [0, 30, 30, 0, 0]  # the 4th shares 3 tokens (< 1/8): a full pass; the 5th none
    gen = SharedPrefixGreedy(model, 8, prefill_chunk=chunk)
    for ids, expected_shared in zip(prompts, shared):
        before = gen.shared_tokens
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)[0, len(ids):]
        assert gen(torch.tensor([ids])) == [ref.tolist()]
        assert gen.shared_tokens - before == expected_shared
        assert len(gen.ids) == len(ids) + 7 == gen.cache.get_seq_length()  # the last new token never ran
    two = torch.tensor([base[:40], base[20:]])  # a batch: no cache kept
    assert gen(two) == greedy_generate(model, two, 8, prefill_chunk=chunk) and gen.cache is None


def test_run_niah_shares_the_haystack_between_depths(tiny):
    """One prompt per batch: the grid's prompts share their haystack up to the shallower needle, the outputs are
    those of runs without sharing (min_shared above 1)."""
    from megatron_ext.evaluate.generate import SharedPrefixGreedy, eos_ids

    model, tok = tiny
    lengths, depths = [128, 200], [0, 25, 50, 75, 100]
    shared = run_niah(model, tok, lengths, depths, batch_tokens=200, max_new_tokens=4, progress=False, log=None)
    plain = SharedPrefixGreedy(model, 4, eos_token_ids=eos_ids(model, tok))
    plain.min_shared = 2.0
    whole = run_niah(None, tok, lengths, depths, generate=plain, batch_tokens=200, max_new_tokens=4,
                     max_position_embeddings=256, progress=False, log=None)
    assert [c["output"] for c in shared.cells] == [c["output"] for c in whole.cells]
    # depths 25..100 share about a quarter more each at 128; at 200, deep to shallow, the first shares the 128-token
    # prompt's whole haystack
    assert sum(lengths) * 1.0 < shared.settings["shared_tokens"] < sum(lengths) * 2.5
    assert plain.shared_tokens == 0


def test_token_losses_match_transformers_loss(tiny):
    model, _ = tiny
    ids = torch.randint(5, TINY["vocab_size"], (200,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
        ref = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        hf_loss = model(ids[None], labels=ids[None]).loss
    for chunk in (None, 13, 64):
        got = token_losses(model, ids, chunk)
        assert got.shape == (199,)
        assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5), (got - ref).abs().max()
    assert abs(got.mean().item() - hf_loss.item()) < 1e-5


def test_perplexity_by_position_buckets_cover_all_positions(tiny, tmp_path):
    model, tok = tiny
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(5, TINY["vocab_size"], (n,), generator=g) for n in (50, 130, 300)]
    res = perplexity_by_position(model, docs, per_octave=2, chunk=64, progress=False)
    assert res.doc_tokens == [50, 130, 256]  # cut to max_position_embeddings
    # what computed the curve (ppl.json of the HF engine recorded neither dtype nor device; the Megatron one did)
    assert {k: res.settings.get(k) for k in ("engine", "device", "dtype")} == \
        {"engine": "hf", "device": "cpu", "dtype": "float32"}
    b = res.buckets
    assert b[0]["start"] == 1 and b[-1]["end"] == 256
    assert all(b[i]["end"] == b[i + 1]["start"] for i in range(len(b) - 1))
    assert sum(x["tokens"] for x in b) == 49 + 129 + 255  # every predicted token counted once
    for x in b:  # a bucket counts one token per document that reaches it
        assert x["tokens"] == sum(max(0, min(x["end"], n) - x["start"]) for n in res.doc_tokens)
    # The token-weighted mean equals the plain mean of all per-token losses.
    allloss = torch.cat([token_losses(model, d[:256], None) for d in docs])
    assert abs(res.mean_loss - allloss.mean().item()) < 1e-5
    texts = perplexity_by_position(model, tok, texts=[" ".join(["The old river passes the garden."] * 20)],
                                   seq_len=100, progress=False)
    assert texts.doc_tokens == [100] and sum(x["tokens"] for x in texts.buckets) == 99
    write_json_atomic(tmp_path / "ppl.json", res.to_dict())
    assert_png(plot_perplexity({"a": res, "b": json.loads((tmp_path / "ppl.json").read_text())},
                               tmp_path / "ppl.png", mark={"trained": 32}))
    with pytest.raises(EvalError, match="needs texts="):
        perplexity_by_position(model, tok, progress=False)


@pytest.mark.parametrize("n_docs", [1, 4])
def test_perplexity_progress_bar_ends_at_every_document(tiny, capsys, n_docs):
    """The bar stopped at 3/4 (0/1 for one document): the loop over (document, loss) pairs ended on the document
    list before the loss generator resumed the bar for its last step, so the bar was never finished."""
    model, _ = tiny
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(5, TINY["vocab_size"], (40,), generator=g) for _ in range(n_docs)]
    perplexity_by_position(model, docs, chunk=None, progress=True)
    err = capsys.readouterr().err
    assert f"{n_docs}/{n_docs}" in err, err


def write_indexed_dataset(prefix, sizes: list[list[int]], seed: int) -> list[list[torch.Tensor]]:
    """A Megatron indexed dataset at `prefix` (.bin/.idx, int32) of random token documents, each of sequences of the
    given sizes (Megatron-Core's own builder); returns the documents' sequences."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(5, 500, (n,), generator=g) for n in parts] for parts in sizes]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for parts in docs:
        for p in parts:
            builder.add_item(p)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return docs


def test_perplexity_on_a_megatron_indexed_dataset(tiny, tmp_path):
    model, _ = tiny
    docs = write_indexed_dataset(tmp_path / "d", [[30, 20], [120], [7, 8, 9]], seed=4)
    got = indexed_documents(tmp_path / "d", max_documents=2)  # the two longest: 120, then 30+20
    assert [len(d) for d in got] == [120, 50]
    assert np.array_equal(got[1], torch.cat(docs[0]).numpy())
    res = perplexity_by_position(model, got, progress=False)
    assert sum(b["tokens"] for b in res.buckets) == 119 + 49
    with pytest.raises(EvalError, match="prepare_data"):
        indexed_documents(tmp_path / "missing")


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 4.0, "beta_slow": 1.0},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_hf_engine_rope_angles_are_exact_far_out(rope):
    """Near 4M tokens transformers' float32 product of position and frequency is off by up to 0.125 rad (the
    control); the engine's rotary module gives the float64 cos/sin there, and transformers' own values where the
    angles are below pi (within float32 spacing up to 300 rad, where the engine tests compare it with generate)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ext.evaluate.hf_rope import Float64RotaryAngles, rope_angles_as_trained
    from megatron_ext.presets import TINY

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, rope_scaling=rope, max_position_embeddings=512)))
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1)

    def cos_sin(module, positions):
        cos, sin = module(x, positions[None])
        return torch.cat([cos, sin], -1)[0].double()

    far = torch.arange(4_194_304 - 300, 4_194_304)
    near = torch.arange(0, 300)
    theirs_far, theirs_near = cos_sin(rotary, far), cos_sin(rotary, near)  # dynamic: inv_freq set for 4M first
    assert rope_angles_as_trained(model) == "float64" and isinstance(model.model.rotary_emb, Float64RotaryAngles)
    assert rope_angles_as_trained(model) == "float64" and model.model.rotary_emb.inner is rotary  # wrapped once
    ours_far = cos_sin(model.model.rotary_emb, far)
    angles = far.double()[:, None] * rotary.inv_freq.double()[None]  # dynamic: the frequencies set for 4M
    emb = torch.cat([angles, angles], -1)  # Llama's half-split layout
    exact = torch.cat([emb.cos(), emb.sin()], -1) * rotary.attention_scaling
    assert (ours_far - exact).abs().max() < 1e-5
    assert (theirs_far - exact).abs().max() > 1e-2  # transformers' own float32 angles
    ours_near = cos_sin(model.model.rotary_emb, near)
    assert torch.equal(ours_near[:4], theirs_near[:4])  # angles below pi: the same float32 values
    np.testing.assert_allclose(ours_near, theirs_near, atol=2e-5)  # up to 300 rad: float32 spacing 3e-5


def test_hf_engine_keeps_float32_angles_of_a_model_trained_with_them():
    """A model trained with `rope.angle_precision: float32` exports `rope_angle_precision: float32`; the engine then
    leaves transformers' own float32 angles (the trainer's table equals them bit for bit: tests/unit/test_rope.py);
    a value that is neither precision is an error naming the key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ext.evaluate.hf_rope import rope_angles_as_trained
    from megatron_ext.presets import TINY

    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, rope_angle_precision="float32")))
    rotary = model.model.rotary_emb
    assert rope_angles_as_trained(model) == "float32" and model.model.rotary_emb is rotary
    model.config.rope_angle_precision = "bf16"
    with pytest.raises(ValueError, match="rope_angle_precision = 'bf16'"):
        rope_angles_as_trained(model)


def test_a_haystack_without_sentence_ends_is_refused():
    """A --haystack without sentence ends (code, a text whose sentences end otherwise) had one needle slot: every
    needle went to 0% or 100% while the heatmap showed the depths asked for."""
    from megatron_ext.evaluate.haystack import _SENTENCE_END, Haystack

    hay = Haystack(np.arange(10_000), np.array([0]), "code.py")
    with pytest.raises(EvalError, match=r"haystack code\.py: tokens 0 to 4,000 of the 4,000 a prompt takes hold no "
                                        r"sentence end, so needles cannot be placed near their depths"):
        hay.needle_slots(4000)
    assert Haystack(np.arange(10_000), np.arange(0, 10_000, 150), "essay").needle_slots(4000)[-1] == 4000  # control
    assert hay.needle_slots(200).tolist() == [0, 200]  # a short prompt: one sentence may fill it
    # CJK sentences end in full-width marks, with no space after them
    assert [m.end() for m in _SENTENCE_END.finditer("他来了。她走了！真的吗？好")] == [4, 8, 12]


def test_perplexity_documents_count_each_upsampled_text_once(tmp_path, toy_tokenizer):
    """prepare_data.py cpt --upsample writes a long document's copies one after another, and the longest are the
    ones upsampled: the 4 longest "documents" were 2 texts, each twice."""
    from megatron_ext.data import prepare_cpt
    from megatron_ext.data.toy import synthetic_corpus, write_jsonl
    from megatron_ext.evaluate.perplexity import indexed_documents

    corpus = write_jsonl(tmp_path / "corpus.jsonl", synthetic_corpus(40, seed=3))
    plain, upsampled = str(tmp_path / "plain"), str(tmp_path / "up")
    prepare_cpt([str(corpus)], toy_tokenizer, plain, progress=False)
    prepare_cpt([str(corpus)], toy_tokenizer, upsampled, upsample="gt1=2.0", progress=False)  # every document twice
    want = indexed_documents(plain, 4)
    got = indexed_documents(upsampled, 4)
    assert len({d.tobytes() for d in got}) == 4
    assert [d.tolist() for d in got] == [d.tolist() for d in want]


# ---------------------------------------------------------------------------------------------- pinned by mutation testing


def test_grid_scores_are_by_depth_and_length(tok):
    """scores[i][j] is the mean over the cells of depths[i] and lengths[j] only. A stub answers right where the
    needle is in the second half of the prompt or the prompt has 256 tokens: a grid that pooled a length's depths
    (or swapped the axes) reads otherwise."""
    def answer(ids: torch.Tensor) -> list[list[int]]:
        out = []
        for row in ids.tolist():
            text = tok.decode(row)
            right = text.index("special magic number is") > len(text) / 2 or len(row) == 256
            out.append(tok(_read_needle(text) if right else " 1234567.", add_special_tokens=False)["input_ids"])
        return out

    res = run_niah(None, tok, [150, 200, 256], [0, 100], samples=2, generate=answer, progress=False, log=None)
    assert res.scores == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]


def test_batched_greedy_rows_stop_at_their_own_eos(tiny):
    """A row's EOS ends that row only: the other rows of the batch keep decoding (oracle: transformers' generate
    without EOS, each row cut after its first EOS)."""
    model, _ = tiny
    ids = torch.randint(5, TINY["vocab_size"], (3, 41), generator=torch.Generator().manual_seed(1))
    model.generation_config.eos_token_id = None
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                         min_new_tokens=10, pad_token_id=0)[:, ids.shape[1]:].tolist()
    eos = ref[0][1]
    want = [r[:r.index(eos) + 1] if eos in r else r for r in ref]
    assert max(map(len, want)) > len(want[0])  # another row runs on past row 0's EOS
    assert greedy_generate(model, ids, 10, eos_token_ids=(eos,)) == want


def test_shared_prefix_greedy_runs_the_same_prompt_twice(tiny):
    """A prompt equal to the one before reuses all its tokens but the last (whose logits give the first answer
    token): the same continuation as transformers' generate, both times."""
    from megatron_ext.evaluate.generate import SharedPrefixGreedy

    model, _ = tiny
    model.generation_config.eos_token_id = None
    ids = torch.randint(5, TINY["vocab_size"], (1, 50), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                         min_new_tokens=6, pad_token_id=0)[:, 50:].tolist()
    gen = SharedPrefixGreedy(model, 6, prefill_chunk=None)
    assert gen(ids) == ref
    assert gen(ids) == ref and gen.shared_tokens == 49


def _sentence_pieces(sentences: list[str], lead: str) -> list[str]:
    return [lead + sentences[0]] + [" " + s for s in sentences[1:]]


def _expected_stream(tok, pieces: list[str], n_tokens: int) -> tuple[list[int], list[int]]:
    """Oracle: each sentence (with the space before it) tokenized alone; a sentence starts at its first token."""
    ids, starts = [], []
    for p in pieces:
        starts.append(len(ids))
        ids += tok(p, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    return ids, starts


def test_builtin_haystack_over_several_blocks_is_the_sentences_tokenized_alone(tok):
    """The filler is tokenized 400 sentences at a time; the stream across block seams must read as one text (a
    space between the blocks' sentences) with every sentence start found."""
    from itertools import islice

    from megatron_ext.evaluate.haystack import filler_sentences

    hay = builtin_haystack(tok, 12_000, seed=5, lead=" ")
    ids, starts = _expected_stream(tok, _sentence_pieces(list(islice(filler_sentences(5), 2000)), " "), 10 ** 9)
    assert len(hay) >= 12_000 and len(hay) < len(ids)  # more than one block (400 sentences ~ 4,400 tokens)
    assert hay.ids.tolist() == ids[:len(hay)]
    assert hay.starts.tolist() == [s for s in starts if s < len(hay)]


def test_file_haystack_over_several_blocks_is_the_file_tokenized_whole(tok, tmp_path):
    """A file longer than a block (64 Ki characters) is cut at sentence ends, so the stream is the file's own
    tokenization; a file that starts with whitespace gets no `lead` before it."""
    from itertools import islice

    from megatron_ext.evaluate.haystack import _BLOCK_CHARS, filler_sentences

    sentences = list(islice(filler_sentences(7), 4000))
    text = "\n" + " ".join(sentences)
    assert len(text) > 2 * _BLOCK_CHARS
    path = tmp_path / "essays.txt"
    path.write_text(text, encoding="utf-8")
    hay = file_haystack(tok, path, 30_000, lead=" ")
    ids, starts = _expected_stream(tok, _sentence_pieces(sentences, "\n"), 10 ** 9)
    assert len(hay) >= 30_000
    assert hay.ids.tolist() == ids[:len(hay)]
    assert hay.starts.tolist() == [s for s in starts if s < len(hay)]


def test_needle_slots_refuse_a_gap_over_5_percent():
    """A stretch of more than 5% of the prompt (and more than 256 tokens) without a sentence start is refused; 4% is
    not (the needle lands within 2% of its depth)."""
    from megatron_ext.evaluate.haystack import Haystack

    def hay(gap: int) -> Haystack:
        starts = np.r_[np.arange(0, 5000, 100), np.arange(5000 + gap, 10_000, 100)]
        return Haystack(np.arange(10_000), starts, "essay")

    assert hay(400).needle_slots(10_000)[-1] == 10_000  # 4%: fine
    with pytest.raises(EvalError, match=r"haystack essay: tokens 4,900 to 5,900 of the 10,000 a prompt takes hold no "
                                        r"sentence end"):
        hay(900).needle_slots(10_000)  # 4,900 .. 5,900: 10%


def test_perplexity_buckets_average_the_losses_of_their_own_positions(tiny):
    """Each bucket's mean_loss is the mean loss of the tokens at positions [start, end) of the documents that reach
    them, and its perplexity exp(mean_loss). The tests above checked only the token counts and the overall mean, which
    losses put in the wrong buckets (or another perplexity formula) keep. Oracle: transformers' logits and torch's
    cross_entropy over each whole document, bucketed here by hand."""
    model, _ = tiny
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(5, TINY["vocab_size"], (n,), generator=g) for n in (40, 100)]
    res = perplexity_by_position(model, docs, per_octave=1, chunk=None, progress=False)
    assert [(b["start"], b["end"]) for b in res.buckets] == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64),
                                                             (64, 100)]
    with torch.no_grad():
        ce = [torch.nn.functional.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="none").double()
              for d in docs]
    for b in res.buckets:
        at = torch.cat([c[b["start"] - 1:b["end"] - 1] for c in ce])  # entry t-1: the token at position t
        assert b["tokens"] == len(at)
        assert b["mean_loss"] == pytest.approx(at.mean().item(), abs=1e-5), b
        assert b["perplexity"] == pytest.approx(math.exp(at.mean().item()), rel=1e-5), b


def test_perplexity_leaves_out_one_token_documents_and_warns_only_beyond_max_positions(tiny):
    """A 1-token document has no loss: it is not counted as a document. Documents cut to max_position_embeddings
    (the default) are not beyond it: no extrapolation warning then, one at seq_len = max_position_embeddings + 1."""
    model, _ = tiny
    doc = torch.randint(5, TINY["vocab_size"], (300,), generator=torch.Generator().manual_seed(12))
    res = perplexity_by_position(model, [doc[:50], doc[:1]], chunk=None, progress=False)
    assert (res.documents, res.doc_tokens) == (1, [50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert perplexity_by_position(model, [doc], chunk=None, progress=False).doc_tokens == [256]
    with pytest.warns(UserWarning, match="beyond the model's max_position_embeddings=256"):
        perplexity_by_position(model, [doc], seq_len=257, chunk=None, progress=False)


def test_token_losses_auto_chunk_is_at_most_4096(tiny):
    """chunk="auto" holds one chunk's logits [c, V] at a time, c at most 4096 (`auto_prefill_chunk` alone gives one
    pass up to 32k tokens: 16 GiB of fp32 logits at Llama-3's vocabulary). A 4,500-token document: two forward calls,
    and the losses are still torch's cross_entropy over transformers' logits of one pass."""
    model, _ = tiny
    ids = torch.randint(5, TINY["vocab_size"], (4500,), generator=torch.Generator().manual_seed(13))
    lengths: list[int] = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: lengths.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)
    try:
        got = token_losses(model, ids, "auto")
    finally:
        hook.remove()
    assert lengths == [4096, 404]
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:], reduction="none")
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5), (got - ref).abs().max()


def test_indexed_documents_longest_first_by_whole_document_then_file_order(tmp_path):
    """Documents of several sequences are ordered by their total length (Megatron's document index), ties in file
    order. Hand numbers: sequences [5, 40], [30], [10, 10, 10], [3] are documents of 45, 30, 30 and 3 tokens."""
    docs = write_indexed_dataset(tmp_path / "d", [[5, 40], [30], [10, 10, 10], [3]], seed=14)
    whole = [torch.cat(parts).numpy() for parts in docs]
    got = indexed_documents(tmp_path / "d")
    assert [d.tolist() for d in got] == [whole[i].tolist() for i in (0, 1, 2, 3)]
    assert [d.tolist() for d in indexed_documents(tmp_path / "d", max_documents=2)] == [whole[0].tolist(),
                                                                                         whole[1].tolist()]
