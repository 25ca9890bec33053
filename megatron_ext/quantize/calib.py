"""Calibration and held-out token windows for the FP8 export.

Sources, tried in this order:
- a Megatron indexed dataset `PREFIX` (PREFIX.bin + PREFIX.idx), as written by our data pipeline;
- a text file (.txt/.md: one document; .jsonl: one document per line, field `text`) or a
  directory of them, tokenized with the model's tokenizer;
- a Hugging Face dataset name (`name` or `name:config`), streamed, column `text`.

Documents are concatenated in order and cut into windows of `seq_length` tokens, as training packs
them (UltraLong trains without document masking), so that every window is a full-length context:
long sequences matter for the KV-cache scales, whose largest values sit at far positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from megatron_ext.quantize.errors import QuantizeError

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")


def _indexed_documents(prefix: str, tokenizer=None,
                       tokenizer_name: str | None = None) -> tuple[Iterator[np.ndarray], int, int]:
    """Documents of a Megatron indexed dataset, read lazily; also its document and token counts. QuantizeError
    for an SFT dataset or its loss mask, or data the manifest says another tokenizer than `tokenizer` made."""
    from megatron_ext.data import DataError
    from megatron_ext.data.dataset_files import check_complete
    from megatron_ext.evaluate.token_data import token_data_problem

    try:
        check_complete(prefix)  # Megatron-Core's reader fails on a cut or foreign file with a bare traceback
    except DataError as e:
        raise QuantizeError(f"--calib: {e}") from None
    # ids below vocab_size pass the range check, and then calibrate the FP8 scales on the wrong text
    problem = token_data_problem(prefix, "--calib", tokenizer, tokenizer_name)
    if problem:
        raise QuantizeError(problem)
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # after the checks: its import warns

    ds = IndexedDataset(prefix)
    # copies: ds[i] is a view into ds's memory map, which closes when ds is collected
    return (np.array(ds[i], dtype=np.int64) for i in range(len(ds))), len(ds), int(np.sum(ds.sequence_lengths))


def _text_documents(path: Path) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise QuantizeError(f"calibration directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
    for f in files:
        if f.suffix == ".jsonl":
            # line by line (a corpus file may be tens of GB), decoded here: a text-mode file names no line
            with open(f, "rb") as lines:
                for n, raw in enumerate(lines, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise _not_utf8(f, n, e.reason, e.start) from None
                    if line.strip():
                        try:
                            text = json.loads(line)["text"]
                        except (ValueError, KeyError, TypeError):
                            raise QuantizeError(f"{f}:{n}: expected a JSON object with a \"text\" field") from None
                        yield _text(text, f"{f}:{n}: \"text\"", "give each line's \"text\" as a JSON string")
        else:
            data = f.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line_start = data.rfind(b"\n", 0, e.start) + 1
                raise _not_utf8(f, data.count(b"\n", 0, e.start) + 1, e.reason, e.start - line_start) from None
            yield text


def _not_utf8(f: Path, line: int, reason: str, offset: int) -> QuantizeError:
    """The error for a calibration file that is not UTF-8, by file and line (a UnicodeDecodeError traceback named
    neither); `offset`: of the bad byte in the line, from 0."""
    return QuantizeError(f"{f}:{line}: not UTF-8 text ({reason} at byte {offset + 1} of the line); save the file as "
                         "UTF-8, or pass an indexed dataset PREFIX")


def _text(value: object, where: str, fix: str) -> str:
    """`value` if it is a string; else a QuantizeError (the tokenizer failed on it with a ValueError traceback)."""
    if not isinstance(value, str):
        raise QuantizeError(f"{where} is {type(value).__name__} {json.dumps(value)[:40]}, not a string: {fix}")
    return value


def _hf_documents(name: str, split: str, text_key: str) -> Iterator[str]:
    import datasets

    path, _, config = name.partition(":")
    try:
        rows = datasets.load_dataset(path, config or None, split=split, streaming=True)
    except Exception as e:
        raise QuantizeError(f"--calib {name!r} is neither PREFIX.bin/.idx, a text file or directory, nor a loadable "
                            f"Hugging Face dataset ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for row in rows:
        if text_key not in row:
            raise QuantizeError(f"Hugging Face dataset {name!r} has no column {text_key!r} (columns: {sorted(row)})")
        yield _text(row[text_key], f"Hugging Face dataset {name!r}, column {text_key!r}",
                    "calibrate on a dataset whose text column holds strings")


def _tokenize(texts: Iterable[str], tokenizer, source: str) -> Iterator[np.ndarray]:
    if tokenizer is None:
        raise QuantizeError(f"calibration text {source} needs a tokenizer, and the model directory has none: "
                            "save one there (tokenizer.save_pretrained) or use an indexed dataset PREFIX")
    for text in texts:
        yield np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)


def _windows(docs: Iterable[np.ndarray], seq_length: int, count: int) -> tuple[list[torch.Tensor], int, int]:
    """Pack `docs` into at most `count` windows of `seq_length`; also tokens and documents read."""
    out: list[torch.Tensor] = []
    buf: list[np.ndarray] = []
    have = tokens = n_docs = 0
    for doc in docs:
        n_docs += 1
        tokens += len(doc)
        buf.append(np.asarray(doc, dtype=np.int64))
        have += len(doc)
        while have >= seq_length and len(out) < count:
            flat = np.concatenate(buf)
            out.append(torch.from_numpy(flat[:seq_length].copy()))  # [seq_length]
            buf, have = [flat[seq_length:]], len(flat) - seq_length
        if len(out) == count:
            break
    return out, tokens, n_docs


def load_windows(source: str, *, samples: int, seq_length: int, held_out: int = 0, tokenizer=None,
                 vocab_size: int | None = None, split: str = "train", text_key: str = "text",
                 tokenizer_name: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`samples` calibration windows and then `held_out` further windows, each [seq_length] int64 tokens.
    `tokenizer_name`: where `tokenizer` came from, named in the error for indexed data of another tokenizer.

    The held-out windows come after the calibration ones in the data, so they share no tokens.
    Raises QuantizeError naming the source and how much data it has when it is too short.
    """
    if samples < 1 or seq_length < 2 or held_out < 0:
        raise QuantizeError(f"--calib-samples must be >= 1 and --calib-seq-length >= 2, got {samples} and {seq_length}")
    need = samples + held_out
    p = Path(source)
    total_tokens = None
    if Path(source + ".bin").is_file() or Path(source + ".idx").is_file():
        for ext in (".bin", ".idx"):
            if not Path(source + ext).is_file():
                raise QuantizeError(f"indexed dataset {source}{ext} is missing (its pair exists): "
                                    "point --calib at a complete PREFIX.bin/.idx")
        docs, n_total_docs, total_tokens = _indexed_documents(source, tokenizer, tokenizer_name)
        what = f"indexed dataset {source}.bin/.idx"
    elif p.exists():
        if p.is_file() and p.suffix not in TEXT_SUFFIXES:
            raise QuantizeError(f"calibration file {p} is not {'/'.join(TEXT_SUFFIXES)}: pass text, JSON lines, "
                                "or an indexed dataset PREFIX (without .bin/.idx)")
        docs, what = _tokenize(_text_documents(p), tokenizer, str(p)), f"calibration text {p}"
    elif source.startswith((".", "/", "~")) or source.endswith(TEXT_SUFFIXES + (".bin", ".idx")):
        raise QuantizeError(f"calibration data {source} not found: expected PREFIX (with PREFIX.bin and PREFIX.idx), "
                            "a text/.jsonl file or directory, or a Hugging Face dataset name")
    else:
        docs, what = _tokenize(_hf_documents(source, split, text_key), tokenizer, source), f"dataset {source}"

    windows, tokens, n_docs = _windows(docs, seq_length, need)
    if len(windows) < need:
        if total_tokens is not None:
            tokens, n_docs = total_tokens, n_total_docs
        extra = f" + {held_out} held out for --check" if held_out else ""
        raise QuantizeError(
            f"{what} has {tokens:,} tokens in {n_docs:,} documents, i.e. {tokens // seq_length} windows of "
            f"{seq_length:,} tokens, but {samples} calibration windows{extra} need {need * seq_length:,} tokens: "
            "lower --calib-samples or --calib-seq-length, or give more data")
    if vocab_size is not None:
        top = max(int(w.max()) for w in windows)
        if top >= vocab_size or min(int(w.min()) for w in windows) < 0:
            raise QuantizeError(f"{what} holds token id {top}, outside the model's vocabulary of {vocab_size}: "
                                "it was tokenized for another model; re-tokenize it with this model's tokenizer")
    return windows[:samples], windows[samples:]
