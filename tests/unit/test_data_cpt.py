"""CPT data: round trip through Megatron-Core's GPTDataset, separators, upsampling, inputs, determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data import DataError, build_cpt_datasets, prepare_cpt, toy
from megatron_ext.data.cpt import copies, parse_upsample, upsample_rate, uniform_hash


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return toy.build_toy_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    docs = list(toy.synthetic_corpus(40, seed=3))
    return toy.write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", docs), docs


def _enc(tok, text: str) -> list[int]:
    # The oracle: transformers' own tokenizer call, not the pipeline's batch path.
    return tok(text, add_special_tokens=False)["input_ids"]


def _stream(ds) -> np.ndarray:
    """The token stream GPTDataset draws from, rebuilt from its samples in unshuffled order."""
    order = np.argsort(ds.shuffle_index)  # ds[i] is sample shuffle_index[i]
    parts = [ds[int(i)] for i in order]
    return np.concatenate([p["tokens"].numpy() for p in parts] + [parts[-1]["labels"].numpy()[-1:]])


@pytest.mark.parametrize("separator", ["<s>", "bos-eos", "none"])
def test_gptdataset_round_trip(tmp_path, tok_dir, hf_tok, corpus, separator):
    path, docs = corpus
    prefix = str(tmp_path / "cpt")
    man = prepare_cpt([str(path)], str(tok_dir), prefix, separator=separator, progress=False)
    S = 64
    train, valid, test = build_cpt_datasets(prefix, S, seed=7, cache_dir=str(tmp_path / "cache"))
    assert valid is None and test is None
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert all(v.shape == (S,) for v in sample.values())
    assert np.array_equal(sample["position_ids"].numpy(), np.arange(S))  # no reset at documents
    assert len(train) == (man["tokens"] - 1) // S
    if separator == "<s>":
        pre, post = [], _enc(hf_tok, "<s>")
    elif separator == "bos-eos":
        pre, post = [hf_tok.convert_tokens_to_ids("<|begin_of_text|>")], [hf_tok.convert_tokens_to_ids("<|end_of_text|>")]
    else:
        pre, post = [], []
    expected = np.concatenate([pre + _enc(hf_tok, docs[d]["text"]) + post for d in train.document_index])
    stream = _stream(train)
    assert stream.size == len(train) * S + 1
    np.testing.assert_array_equal(stream, expected[: stream.size])
    for i in (0, len(train) - 1):  # labels are the tokens shifted by one
        s = train[i]
        assert np.array_equal(s["labels"][:-1].numpy(), s["tokens"][1:].numpy())
    # negative control: GPTDataset really shuffles documents, so file order would not match
    file_order = np.concatenate([pre + _enc(hf_tok, d["text"]) + post for d in docs])
    assert not np.array_equal(stream, file_order[: stream.size])


def _find(stream: np.ndarray, pattern: list[int]) -> list[int]:
    k = len(pattern)
    win = np.lib.stride_tricks.sliding_window_view(stream, k)
    return np.flatnonzero((win == np.array(pattern)).all(axis=1)).tolist()


def test_separator_exactly_between_documents(tmp_path, tok_dir, hf_tok, corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path, docs = corpus
    sep = _enc(hf_tok, "<s>")
    assert len(sep) > 1  # '<s>' is ordinary text for this tokenizer, as for Llama-3
    prefix = str(tmp_path / "sep")
    prepare_cpt([str(path)], str(tok_dir), prefix, progress=False)
    ds = IndexedDataset(prefix)
    stream = np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)
    ends = np.cumsum(ds.sequence_lengths)
    assert _find(stream, sep) == (ends - len(sep)).tolist()  # one separator per boundary, nowhere else
    # negative control: with --separator none the pattern never occurs
    prepare_cpt([str(path)], str(tok_dir), str(tmp_path / "nosep"), separator="none", progress=False)
    ds2 = IndexedDataset(str(tmp_path / "nosep"))
    assert _find(np.concatenate([ds2[i] for i in range(len(ds2))]).astype(np.int64), sep) == []


def test_upsample_rules_pure():
    rules = parse_upsample("lt4k=0.5,gt8k=2.0,arxiv:gt8k=3,github=0.25")
    assert upsample_rate(rules, "web", 4095) == 0.5
    assert upsample_rate(rules, "web", 4096) == 1.0
    assert upsample_rate(rules, "web", 8192) == 1.0
    assert upsample_rate(rules, "web", 8193) == 2.0
    assert upsample_rate(rules, "arxiv", 9000) == 3.0
    assert upsample_rate(rules, "arxiv", 100) == 0.5  # no arxiv rule for short docs: generic one applies
    assert upsample_rate(rules, "github", 100) == 0.25
    assert [copies(2.0, 1, i) for i in range(5)] == [2] * 5
    u = np.array([uniform_hash(5, i) for i in range(20000)])
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    # adjacent classes (gt4095 is [4096, inf), lt4096 is [0, 4096)) do not overlap; a rate of 0 drops (docstring)
    adjacent = parse_upsample("gt4095=2,lt4096=0.5,code=0")
    assert [upsample_rate(adjacent, "web", n) for n in (4095, 4096)] == [0.5, 2.0]
    assert upsample_rate(adjacent, "code", 10) == 0.0 and copies(0.0, 1, 0) == 0
    for bad in ("lt4k", "web:lt4q=1", "gt8k=-1", "lt4k=0.5,lt2k=2"):
        with pytest.raises(DataError, match="--upsample"):
            parse_upsample(bad)


def test_length_histogram_power_of_two_bins():
    """Bins [2^k, 2^(k+1)) by hand: a length of exactly 2^k opens its bin."""
    from megatron_ext.data.common import length_histogram

    assert length_histogram(np.array([1, 2, 3, 4, 7, 8, 1023, 1024, 1025])) == {
        "[1, 2)": 1, "[2, 4)": 2, "[4, 8)": 2, "[8, 16)": 1, "[512, 1024)": 1, "[1024, 2048)": 2}
    assert length_histogram(np.array([], dtype=np.int64)) == {}


def test_upsampling_ratios_hold(tmp_path, tok_dir, hf_tok):
    sources = {"short": (5, 15), "mid": (120, 160), "long": (400, 500)}
    docs = list(toy.synthetic_corpus(600, seed=11, sources=sources))
    lengths = {s: [len(_enc(hf_tok, d["text"])) for d in docs if d["source"] == s] for s in sources}
    lt, gt = max(lengths["short"]) + 1, min(lengths["long"]) - 1
    assert lt <= min(lengths["mid"]) and max(lengths["mid"]) <= gt  # three clean length classes
    path = toy.write_jsonl(tmp_path / "c.jsonl", docs)
    spec = f"lt{lt}=0.5,gt{gt}=2.0,mid:all=1.5"
    man = prepare_cpt([str(path)], str(tok_dir), str(tmp_path / "up"), source_field="source", upsample=spec,
                      progress=False, seed=5)
    ps = man["per_source"]
    n = 200
    for name, rate in (("short", 0.5), ("mid", 1.5), ("long", 2.0)):
        assert ps[name]["documents_read"] == n
        frac = rate - int(rate)
        sigma = math.sqrt(n * frac * (1 - frac))
        got = ps[name]["documents_written"]
        assert abs(got - n * rate) <= 4 * sigma, (name, got, n * rate)
    assert ps["long"]["documents_written"] == 2 * n  # integer rates are exact
    assert ps["short"]["documents_written"] != n  # negative control: rate 0.5 really drops documents
    # the decision per document is the pure `copies` function (independent of batching)
    expect = sum(copies(upsample_rate(parse_upsample(spec), d["source"], len(_enc(hf_tok, d["text"]))), 5, i)
                 for i, d in enumerate(docs))
    assert man["documents"] == expect


def test_deterministic_and_seeded(tmp_path, tok_dir, corpus):
    path, _ = corpus
    outs = []
    for name, seed, batch in (("a", 1, 1024), ("b", 1, 7), ("c", 2, 1024)):
        prepare_cpt([str(path)], str(tok_dir), str(tmp_path / name), upsample="all=1.5", seed=seed,
                    batch_docs=batch, progress=False)
        outs.append([(tmp_path / f"{name}{ext}").read_bytes() for ext in (".bin", ".idx")])
    assert outs[0] == outs[1]  # same seed, different batching: byte-identical
    assert outs[0][0] != outs[2][0]  # another seed picks other copies
    ja, jb = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    ja["settings"].pop("inputs"), jb["settings"].pop("inputs")
    assert ja == jb


def test_inputs_jsonl_parquet_txt_and_datasets_stream(tmp_path, tok_dir, corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, docs = corpus
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "c.parquet")
    (tmp_path / "c.txt").write_text("".join(d["text"] + "\n" for d in docs), encoding="utf-8")
    folder = tmp_path / "hfds"
    folder.mkdir()
    toy.write_jsonl(folder / "train.jsonl", docs)
    bins = []
    for name, src in (("j", path), ("p", tmp_path / "c.parquet"), ("t", tmp_path / "c.txt"), ("h", folder)):
        man = prepare_cpt([str(src)], str(tok_dir), str(tmp_path / name), progress=False)
        assert man["documents"] == len(docs)
        bins.append((tmp_path / f"{name}.bin").read_bytes())
    assert bins[0] == bins[1] == bins[2] == bins[3]
    # a hub name is streamed by `datasets`; a local folder under the same code path stands in for the hub here
    from megatron_ext.data.sources import _rows_hf

    assert [row["text"] for _, row in _rows_hf(str(folder))] == [d["text"] for d in docs]


def test_max_tokens_and_manifest(tmp_path, tok_dir, corpus, capsys):
    path, _ = corpus
    full = prepare_cpt([str(path)], str(tok_dir), str(tmp_path / "full"), source_field="source", progress=False)
    assert "stopped the read" not in capsys.readouterr().err
    cut = prepare_cpt([str(path)], str(tok_dir), str(tmp_path / "cut"), max_tokens=2000, progress=False)
    # the cut keeps the head of the input order, which a source-sorted corpus would skew: said
    assert (f"note: --max-tokens 2000 stopped the read after {cut['documents_read']} documents: the data is the "
            "head of the inputs' order") in capsys.readouterr().err
    assert 2000 <= cut["tokens"] < 2000 + max(int(k.split(",")[1].strip(" )")) for k in full["length_histogram"])
    assert cut["tokens"] < full["tokens"]
    assert sum(full["length_histogram"].values()) == full["documents"] == 40
    assert sum(s["tokens_written"] for s in full["per_source"].values()) == full["tokens"]
    assert set(full["per_source"]) == {"web", "book", "code"}
    assert full["tokenizer_hash"].startswith("sha256:") and full["separator_ids"]["suffix"]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert int(IndexedDataset(str(tmp_path / "full")).sequence_lengths.sum()) == full["tokens"]
    # the trainer compares max_token_id with model.vocab_size (check_setup): it is the largest id in the .bin
    tokens = np.fromfile(tmp_path / "full.bin", dtype=full["dtype"])
    assert full["max_token_id"] == int(tokens.max()) < full["vocab_size"]


def test_reprepared_prefix_does_not_reuse_stale_index_cache(tmp_path, tok_dir, hf_tok):
    """Re-preparing other documents under the same PREFIX (prepare_data --force) must not reuse the
    GPTDataset index cache built for the old ones: Megatron-Core keys that cache by path and settings,
    not by content, so a stale index once produced a sample spanning the whole corpus."""
    prefix, cache, S = str(tmp_path / "cpt"), str(tmp_path / "cache"), 32
    long_docs = toy.write_jsonl(tmp_path / "long.jsonl", toy.synthetic_corpus(40, seed=3))
    prepare_cpt([str(long_docs)], str(tok_dir), prefix, progress=False)
    first = build_cpt_datasets(prefix, S, seed=7, num_samples=(60, None, None), cache_dir=cache)[0]
    first[0]
    # Other, shorter documents under the same prefix, with the same sample count and seed.
    short = [{"id": i, "text": f"note {i}."} for i in range(2000)]
    prepare_cpt([str(toy.write_jsonl(tmp_path / "short.jsonl", short))], str(tok_dir), prefix, force=True,
                progress=False)
    second = build_cpt_datasets(prefix, S, seed=7, num_samples=(60, None, None), cache_dir=cache)[0]
    assert len(second.document_index) != len(first.document_index)  # rebuilt for the new documents
    for i in range(len(second)):
        s = second[i]
        assert s["tokens"].shape == (S,) and s["labels"].shape == (S,)
    texts = hf_tok.decode(second[0]["tokens"].tolist())
    assert "note" in texts


def test_special_token_text_in_a_document_stays_text(tmp_path, tok_dir, hf_tok):
    """A web page quoting "<|eot_id|>" or "<|begin_of_text|>" was tokenized to the control tokens themselves: the
    model trained on turn ends and sequence starts in the middle of documents. A lone surrogate in one line's text
    ("\\ud800", valid JSON) ended the whole preparation with a traceback; it is skipped and counted."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    text = "The template ends a turn with <|eot_id|> and starts with <|begin_of_text|> here."
    specials = set(hf_tok.convert_tokens_to_ids(["<|eot_id|>", "<|begin_of_text|>"]))
    assert specials <= set(hf_tok(text, add_special_tokens=False)["input_ids"])  # what encoding did before
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n" + '{"text": "bad \\ud800 text"}\n' + json.dumps({"text": text}))
    man = prepare_cpt([str(path)], str(tok_dir), str(tmp_path / "cpt"), separator="none", progress=False)
    assert man["documents"] == 2 and man["skipped"]["non_utf8_lines"] == 1
    ds = IndexedDataset(str(tmp_path / "cpt"))
    ids = ds[0].tolist()
    assert not specials & set(ids) and hf_tok.decode(ids) == text


def test_progress_in_a_log_file_is_plain_lines(tmp_path, tok_dir, corpus, capsys, monkeypatch):
    """stderr a file (a Slurm log): every update of the bar was a '\\r' redraw on one line (~100 KB for 40 minutes of
    CPT), with no percentage even for --max-tokens. Now each update is a line of its own (every
    LOG_PROGRESS_SECONDS, 0 here: every document), with the percentage of --max-tokens."""
    from megatron_ext import progress

    monkeypatch.setattr(progress, "LOG_PROGRESS_SECONDS", 0.0)
    prepare_cpt([str(corpus[0])], str(tok_dir), str(tmp_path / "cut"), max_tokens=2000)
    err = capsys.readouterr().err  # not a terminal, as a log file
    bars = [ln for ln in err.splitlines() if ln.startswith("cpt: ") and "tok/s" in ln]
    assert "\r" not in err and err.startswith(f"cpt: loading tokenizer {tok_dir}\n"), err
    assert len(bars) >= 4 and all("%|" in ln for ln in bars) and "/2.00k [" in bars[1], err
    assert bars[-1].startswith("cpt: 100%|"), err  # the last document overshoots --max-tokens: still 100%
    # a corpus shorter than --max-tokens ends at 100% of what it had (it ended at 0% of 1G, with an ETA)
    prepare_cpt([str(corpus[0])], str(tok_dir), str(tmp_path / "all"), max_tokens=10**9)
    bars = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("cpt: ") and "tok/s" in ln]
    assert bars[-1].startswith("cpt: 100%|") and "1.00G" not in bars[-1], bars[-1]


def test_progress_on_a_terminal_redraws_in_place():
    """On a terminal the bar stays tqdm's own: redrawn in place, one line."""
    import io

    from megatron_ext.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with progress_bar(desc="cpt", unit="tok", total=10, file=out) as bar:
        for _ in range(10):
            bar.update(1)
    assert out.getvalue().startswith("\rcpt:") and out.getvalue().count("\n") == 1, repr(out.getvalue())


def test_manifest_counts_and_boundaries_hand_computed(tmp_path, tok_dir, hf_tok):
    """The manifest's counts against numbers computed here from transformers' own encoding: per-source tokens
    count every upsampled copy; max_token_id includes the separator (the trainer compares it with
    model.vocab_size); --max-tokens met exactly stops the read there; --seq-length S needs S + 1 tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [{"text": "alpha beta gamma.", "source": "a"}, {"text": "delta epsilon.", "source": "b"},
            {"text": "zeta eta theta iota.", "source": "b"}]
    ids = [_enc(hf_tok, d["text"]) for d in docs]
    # the separator: the largest id that is one token of its own and in no document, so it is the corpus' largest
    backend = hf_tok.backend_tokenizer
    sep_id = next(i for i in range(len(hf_tok) - 1, 0, -1)
                  if backend.encode(hf_tok.decode([i]), add_special_tokens=False).ids == [i]
                  and hf_tok.decode([i]).strip() and i > max(max(x) for x in ids))
    sep = hf_tok.decode([sep_id])
    sizes = [len(x) + 1 for x in ids]  # tokens + one separator token
    path = toy.write_jsonl(tmp_path / "c.jsonl", docs)

    def prep(name: str, **kw) -> dict:
        return prepare_cpt([str(path)], str(tok_dir), str(tmp_path / name), source_field="source", separator=sep,
                           upsample="a=2", progress=False, **kw)

    man = prep("full")
    total = 2 * sizes[0] + sizes[1] + sizes[2]
    assert man["per_source"]["a"] == {"documents_read": 1, "documents_written": 2, "tokens_written": 2 * sizes[0]}
    assert man["per_source"]["b"] == {"documents_read": 2, "documents_written": 2, "tokens_written": sizes[1] + sizes[2]}
    assert man["tokens"] == total and man["documents"] == 4
    assert man["max_token_id"] == sep_id == int(np.fromfile(tmp_path / "full.bin", dtype=man["dtype"]).max())
    stored = IndexedDataset(str(tmp_path / "full"))  # kept: its items are views of its memory map
    assert stored[0].tolist() == stored[1].tolist() == ids[0] + [sep_id]
    # --max-tokens reached exactly by the first document's copies: nothing more is read
    cut = prep("cut", max_tokens=2 * sizes[0])
    assert (cut["documents_read"], cut["tokens"]) == (1, 2 * sizes[0])
    # one sequence of S tokens needs S + 1 (the labels are the tokens shifted by one)
    assert prep("fits", seq_length=total - 1)["tokens"] == total
    with pytest.raises(DataError, match=f"corpus has {total} tokens but one sequence of --seq-length {total} needs "
                                        f"{total + 1}"):
        prep("short", seq_length=total)
    assert not (tmp_path / "short.json").exists()


@pytest.mark.parametrize("vocab_size", [65535, 65536, 65537, 128256])
def test_token_dtype_holds_every_id_and_halves_when_it_can(tmp_path, vocab_size):
    """The largest id (vocab_size - 1) written with the chosen dtype reads back through Megatron-Core's reader
    (65,536 ids still fit uint16: 0..65535), and uint16 is chosen whenever it holds them."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from megatron_ext.data.common import token_dtype

    dtype = token_dtype(vocab_size)
    assert (dtype is np.uint16) == (vocab_size - 1 <= np.iinfo(np.uint16).max)
    ids = np.array([0, 1, vocab_size - 2, vocab_size - 1], dtype=np.int64)
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=dtype)
    builder.add_document(torch.from_numpy(ids.astype(dtype)), [len(ids)])
    builder.finalize(str(tmp_path / "d.idx"))
    ds = IndexedDataset(str(tmp_path / "d"))  # kept alive: ds[0] is a view of its memory map
    assert np.array_equal(np.asarray(ds[0], dtype=np.int64), ids)


def test_atomic_outputs_cut_between_renames_leaves_no_manifest(tmp_path):
    """--force over an older dataset, the renames cut short after the new .bin (here: the new .idx is missing, so
    its rename fails): the older manifest is gone and the new one not in place, so the new .bin beside the old .idx
    does not look like a complete dataset."""
    from megatron_ext.data.common import atomic_outputs, output_paths

    prefix = str(tmp_path / "d")
    for p in output_paths(prefix):
        p.write_text("old")
    with pytest.raises(FileNotFoundError):
        with atomic_outputs(prefix) as tmp:
            Path(tmp[prefix + ".bin"]).write_text("new")
            Path(tmp[prefix + ".json"]).write_text("new")
    assert Path(prefix + ".bin").read_text() == "new" and Path(prefix + ".idx").read_text() == "old"
    assert not Path(prefix + ".json").exists()
    # and the new manifest's temporary, not renamed, is removed (it was left as d.json.tmpPID)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]
