"""Streaming readers for the corpus inputs: local .jsonl/.json/.parquet/.txt files and `datasets`.

An input SRC is
- an existing file: `.jsonl`/`.json` (one JSON object per line), `.parquet`, `.txt` (one document
  per line); `.gz` variants of jsonl/txt are read through gzip (a name and first bytes that
  disagree about gzip, or gzip data cut short, is a DataError naming the file);
- an existing folder, or anything else shaped like a hub name (`[owner/]name`, optionally
  `[owner/]name:split`): opened with `datasets.load_dataset(..., streaming=True)`, so nothing is
  downloaded up front and memory stays bounded.

Rows are yielded one at a time with a location string ("file.jsonl:17") for error messages.
Non-UTF-8 lines, malformed JSON lines and JSON lines that hold no object are counted and skipped (never a crash
mid-run). A whole-file JSON array (or an object spread over lines) is refused: reading it would need the whole
file in memory, and skipping it line by line would report every line as bad.
"""

from __future__ import annotations

import gzip
import json
import logging
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.data.common import DataError

_LOCAL = (".jsonl", ".json", ".parquet", ".txt", ".jsonl.gz", ".json.gz", ".txt.gz")
_JSON = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


# How a skipped kind is named in warnings (default: the field name with '-' for '_').
_LABELS = {"not_object": "not-an-object"}


@dataclass
class ReadStats:
    """Counts of skipped input lines (reported in the manifest and as warnings)."""

    non_utf8: int = 0
    bad_json: int = 0
    not_object: int = 0  # valid JSON, but a list/string/number where a row (an object) belongs
    empty: int = 0
    first_problem: dict[str, str] = field(default_factory=dict)

    def skip(self, kind: str, where: str, detail: str = "") -> None:
        """Count one skipped line of `kind`; the first one of each kind is a warning naming its place."""
        setattr(self, kind, getattr(self, kind) + 1)
        if kind not in self.first_problem:
            self.first_problem[kind] = where
            print(f"warning: {where}: {_LABELS.get(kind, kind.replace('_', '-'))} line skipped{detail} (further ones "
                  "are counted and reported at the end)", file=sys.stderr)

    def summary(self) -> str:
        """The skipped-line counts in one phrase, for 'nothing usable' errors."""
        return f"{self.non_utf8} non-UTF-8, {self.bad_json} bad JSON, {self.not_object} not-an-object lines"

    def report(self) -> None:
        """The end-of-run report the first warnings promise: each kind's count and first place."""
        for kind in ("non_utf8", "bad_json", "not_object"):
            if getattr(self, kind):
                print(f"warning: skipped {getattr(self, kind)} {_LABELS.get(kind, kind.replace('_', '-'))} lines "
                      f"(first at {self.first_problem[kind]})", file=sys.stderr)


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
    """Fail early (before any output is opened) on inputs that cannot be read, or that are given twice."""
    if not inputs:
        raise DataError("--input: no input given")
    seen: dict[str, str] = {}
    for src in inputs:
        p = Path(src)
        # the same file under two spellings (a/b.jsonl, ./a/b.jsonl) would be read twice: its documents doubled
        key = str(p.resolve()) if p.exists() else src
        if key in seen:
            also = f" (also as {seen[key]})" if seen[key] != src else ""
            raise DataError(f"--input {src}: given twice{also}, so its data would be read twice; drop the repeat "
                            "(cpt weights a source with --upsample SOURCE:all=RATE)")
        seen[key] = src
        if p.is_file():
            if not src.endswith(_LOCAL):
                raise DataError(f"--input {src}: unsupported file type; use one of {', '.join(_LOCAL)}")
            if not src.endswith(".parquet"):
                _check_compression(src)
        elif not p.exists():
            looks_local = src.endswith(_LOCAL) or src.startswith((".", "/", "~")) or src.count("/") > 1
            if looks_local:
                raise DataError(f"--input {src}: file not found")


_GZIP_MAGIC = b"\x1f\x8b"


def _check_compression(src: str) -> None:
    """DataError when a text input's name and its first bytes disagree about gzip: a `.gz` name on plain text
    (gzip refused it with a traceback), or gzip data under a plain name (every line was skipped as non-UTF-8)."""
    try:
        with open(src, "rb") as f:
            head = f.read(2)
    except OSError as e:
        raise DataError(f"--input {src}: cannot read it ({e.strerror or e}); check the path and its permissions") \
            from None
    if src.endswith(".gz") and head and head != _GZIP_MAGIC:
        plain = src[: -len(".gz")]
        raise DataError(f"--input {src}: not gzip data (it starts with {head!r}, not the gzip bytes 1f 8b); if it "
                        f"is plain text, rename it to {Path(plain).name} (or compress it: gzip -c {plain} > {src})")
    if not src.endswith(".gz") and head == _GZIP_MAGIC:
        raise DataError(f"--input {src}: is gzip-compressed (it starts with the gzip bytes 1f 8b), but its name "
                        f"says plain text; rename it to {Path(src).name}.gz (or decompress it: gunzip -c)")


def _lines(path: Path, stats: ReadStats) -> Iterator[tuple[int, str]]:
    gz = path.name.endswith(".gz")
    n = 0
    with (gzip.open if gz else open)(path, "rb") as f:
        lines = enumerate(f, 1)
        while True:
            try:
                n, raw = next(lines)
            except StopIteration:
                return
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # only a .gz input raises these
                if not gz:
                    raise
                where = f"after line {n}" if n else "before its first line"
                kind = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__
                raise DataError(f"--input {path}: gzip data cut short or corrupt {where} ({kind}: {e}); "
                                f"copy or download the file again (`gzip -t {path}` tells whether it is whole)") \
                    from None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("non_utf8", f"{path}:{n}")
                continue
            yield n, line


_BAD = object()  # a line that is not JSON at all


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
        first = True
        for n, line in _lines(path, stats):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = _BAD
            if first:
                _check_json_lines(path, line, row)
                first = False
            if row is _BAD:
                stats.skip("bad_json", f"{path}:{n}")
                continue
            if not isinstance(row, dict):
                stats.skip("not_object", f"{path}:{n}", f" (a JSON {_json_kind(row)}, not an object)")
                continue
            yield f"{path}:{n}", row


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _check_json_lines(path: Path, line: str, row: Any) -> None:
    """DataError when the first line of a .json/.jsonl input shows the file is not JSON Lines at all: a JSON array
    of objects (on one line, or opened by a lone '[') or an object spread over several lines (a lone '{')."""
    head = line.strip()
    if (isinstance(row, list) and row and all(isinstance(r, dict) for r in row)) or (
            row is _BAD and head.startswith("[")):
        what, fix = "is a JSON array", f"jq -c '.[]' {path} > OUT.jsonl"
    elif row is _BAD and head == "{":
        what, fix = "holds a JSON object spread over several lines", f"jq -c . {path} > OUT.jsonl"
    else:
        return
    raise DataError(f"--input {path}: .json/.jsonl inputs must be JSON Lines (one object per line), but {path} "
                    f"{what}; write one object per line (e.g. `{fix}`) and pass that file")


def _rows_hf(src: str) -> Iterator[tuple[str, dict]]:
    name, _, split = src.partition(":") if not Path(src).exists() else (src, "", "")
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split or "train", streaming=True)
    except Exception as e:  # noqa: BLE001 - hub/network/format errors all become one line
        msg = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"--input {src}: cannot open as a Hugging Face dataset ({type(e).__name__}: {msg})") from None
    rows = iter(ds)
    n = 0
    # The JSON builder logs a malformed file before raising; our error names the file and line itself.
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)
    try:
        while True:
            # `datasets` reads lazily: a malformed file shows up here, mid-stream, as a pyarrow/pandas error.
            # Only next() is guarded, so errors of the consumer (thrown in at the yield) are not relabelled.
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - pyarrow/pandas/hub errors all become one line
                raise DataError(_stream_error(src, n, e)) from None
            n += 1
            yield f"{src}:row {n}", row
    finally:
        json_log.setLevel(level)


def _stream_error(src: str, n_read: int, e: Exception) -> str:
    """The message for a `datasets` stream that failed after `n_read` rows; for a local folder, the first line
    that is not JSON (found by reading its .json/.jsonl files the way file inputs are read) and the fix."""
    msg = str(e).splitlines()[0] if str(e) else ""
    head = f"--input {src}: reading it with `datasets` failed after {n_read} rows ({type(e).__name__}: {msg})"
    if not Path(src).is_dir():
        return head
    bad = _first_bad_json_line(Path(src))
    files = f"{src.rstrip('/')}/*.jsonl"
    if bad:
        return (f"{head}; {bad} is not valid JSON: fix that line, or pass the files themselves (--input {files}), "
                "which skips and counts bad lines")
    return f"{head}; fix the folder's files, or pass the files themselves (--input {files})"


def _first_bad_json_line(folder: Path) -> str | None:
    """'FILE:LINE' of the first line of the folder's .json/.jsonl files that is not JSON; None when all parse.
    A file that is one JSON document (an array, a pretty-printed object) is fine: `datasets` reads those whole."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(_JSON)):
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                bad = next((n for n, raw in enumerate(f, 1) if raw.strip() and not _parses(raw)), None)
            if bad is not None:
                with opener(path, "rb") as f:
                    if not _parses(f.read()):
                        return f"{path}:{bad}"
        except (EOFError, OSError, zlib.error):  # a .gz that is not gzip data, or cut short: not a JSON matter
            continue
    return None


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


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
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): the tokenizer refused the whole batch
            stats.skip("non_utf8", where, " (a lone surrogate in its text)")
            continue
        yield source, text
