"""Streaming readers for the corpus inputs: local .jsonl/.json/.parquet/.txt files and `datasets`.

An input SRC is
- an existing file: `.jsonl`/`.json` (one JSON object per line), `.parquet`, `.txt` (one document
  per line); `.gz` variants of jsonl/txt are read through gzip;
- an existing folder, or anything else shaped like a hub name (`[owner/]name`, optionally
  `[owner/]name:split`): opened with `datasets.load_dataset(..., streaming=True)`, so nothing is
  downloaded up front and memory stays bounded.

Rows are yielded one at a time with a location string ("file.jsonl:17") for error messages.
Non-UTF-8 and malformed JSON lines are counted and skipped (never a crash mid-run).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.data.common import DataError

_LOCAL = (".jsonl", ".json", ".parquet", ".txt", ".jsonl.gz", ".json.gz", ".txt.gz")


@dataclass
class ReadStats:
    """Counts of skipped input lines (reported in the manifest and as warnings)."""

    non_utf8: int = 0
    bad_json: int = 0
    empty: int = 0
    first_problem: dict[str, str] = field(default_factory=dict)

    def skip(self, kind: str, where: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind not in self.first_problem:
            self.first_problem[kind] = where
            print(f"warning: {where}: {kind.replace('_', '-')} line skipped (further ones are counted "
                  "and reported at the end)", file=sys.stderr)


def get_field(row: dict, dotted: str) -> Any:
    """`row['a']['b']` for `dotted='a.b'`; KeyError when any part is missing."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def input_name(src: str) -> str:
    """A short name for an input, used as its source label when no source field is given."""
    p = Path(src)
    if p.exists():
        name = p.name
        for ext in _LOCAL:
            if name.endswith(ext):
                return name[: -len(ext)]
        return name
    return src.split(":")[0]


def check_inputs(inputs: list[str]) -> None:
    """Fail early (before any output is opened) on inputs that cannot be read."""
    if not inputs:
        raise DataError("--input: no input given")
    for src in inputs:
        p = Path(src)
        if p.is_file():
            if not src.endswith(_LOCAL):
                raise DataError(f"--input {src}: unsupported file type; use one of {', '.join(_LOCAL)}")
        elif not p.exists():
            looks_local = src.endswith(_LOCAL) or src.startswith((".", "/", "~")) or src.count("/") > 1
            if looks_local:
                raise DataError(f"--input {src}: file not found")


def _lines(path: Path, stats: ReadStats) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("non_utf8", f"{path}:{n}")
                continue
            yield n, line


def _rows_local(path: Path, stats: ReadStats) -> Iterator[tuple[str, dict]]:
    name = path.name
    if name.endswith((".txt", ".txt.gz")):
        for n, line in _lines(path, stats):
            yield f"{path}:{n}", {"text": line.rstrip("\n")}
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow error types vary
            raise DataError(f"--input {path}: not a readable parquet file ({e})") from None
        n = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}:row {n}", row
    else:
        for n, line in _lines(path, stats):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                stats.skip("bad_json", f"{path}:{n}")
                continue
            if not isinstance(row, dict):
                stats.skip("bad_json", f"{path}:{n}")
                continue
            yield f"{path}:{n}", row


def _rows_hf(src: str) -> Iterator[tuple[str, dict]]:
    name, _, split = src.partition(":") if not Path(src).exists() else (src, "", "")
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split or "train", streaming=True)
    except Exception as e:  # noqa: BLE001 - hub/network/format errors all become one line
        msg = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"--input {src}: cannot open as a Hugging Face dataset ({type(e).__name__}: {msg})") from None
    for n, row in enumerate(ds, 1):
        yield f"{src}:row {n}", row


def iter_rows(inputs: list[str], stats: ReadStats) -> Iterator[tuple[str, str, dict]]:
    """Yield (input name, location, row dict) over all inputs in order."""
    for src in inputs:
        p = Path(src)
        rows = _rows_local(p, stats) if p.is_file() else _rows_hf(src)
        name = input_name(src)
        for where, row in rows:
            yield name, where, row


def iter_texts(inputs: list[str], text_field: str, source_field: str | None,
               stats: ReadStats) -> Iterator[tuple[str, str]]:
    """Yield (source, text) per document. DataError on a missing text/source field, and on a text field that holds
    no string (a number, a dict: the wrong field, which was skipped as an empty line, line after line); an empty
    string or null is an empty document, counted and skipped."""
    for name, where, row in iter_rows(inputs, stats):
        try:
            text = get_field(row, text_field)
        except KeyError:
            raise DataError(f"{where}: no field '{text_field}' (fields: {', '.join(sorted(row))}); "
                            "pass --text-field NAME") from None
        if text is not None and not isinstance(text, str):
            kind = type(text).__name__
            kind = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
            hint = ""
            if isinstance(text, dict) and text:
                keys = sorted(map(str, text))
                kind += f" (holding {', '.join(keys)})"
                hint = f"; a dotted name such as {text_field}.{keys[0]} reaches inside a dict"
            raise DataError(f"{where}: field '{text_field}' is {kind}, not a string; give --text-field the name of "
                            f"the text field (fields: {', '.join(sorted(row))}{hint})")
        if source_field:
            try:
                source = str(get_field(row, source_field))
            except KeyError:
                raise DataError(f"{where}: no field '{source_field}' (fields: {', '.join(sorted(row))}); "
                                "fix --source-field or omit it (then the input name is the source)") from None
        else:
            source = name
        if not text:
            stats.skip("empty", where)
            continue
        yield source, text
