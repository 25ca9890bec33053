"""Streaming readers for the corpus inputs: local .jsonl/.json/.parquet/.txt files and `datasets`.

An input SRC is
- an existing file: `.jsonl`/`.json` (one JSON object per line), `.parquet`, `.txt` (one document
  per line); `.gz` variants of jsonl/txt are read through gzip (a name and first bytes that
  disagree about gzip, or gzip data cut short, is a DataError naming the file);
- an existing folder: every data file in it and its subfolders, linked ones too (the types above; hidden files
  and folders, and folders named `__*`, left out as `datasets` does), read in sorted path order exactly as if
  each were given itself. All must be of one type (`.gz` aside): a folder of .jsonl shards that also holds a
  README.txt or a tokenizer's .json files is refused with each type's files named, not read as documents.
  Files of other types (.npy, .md, .bin/.idx) are left out with one warning, and so are the files this stack and
  Megatron-Core write beside data (a prepared PREFIX.json manifest beside its PREFIX.idx, the index cache's
  `<md5>-<class>-<split>-description.txt`, JSON in a .txt). (`datasets` read a folder as a dataset with splits: a folder holding
  one file with "train" in its name had only that file read, the rest silently dropped.);
- anything else shaped like a hub name (`[owner/]name`, optionally `[owner/]name:split`): opened with
  `datasets.load_dataset(..., streaming=True)`, so nothing is downloaded up front and memory stays bounded.

Rows are yielded one at a time with a location string ("file.jsonl:17") for error messages.
Non-UTF-8 lines, malformed JSON lines and JSON lines that hold no object are counted and skipped (never a crash
mid-run). A whole-file JSON array (or an object spread over lines) is refused: reading it would need the whole
file in memory, and skipping it line by line would report every line as bad.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.data.common import DataError

_LOCAL = (".jsonl", ".json", ".parquet", ".txt", ".jsonl.gz", ".json.gz", ".txt.gz")
# Megatron-Core's index cache beside the data (FOLDER/cache/<md5>-<class>-<split>-<name>): its description is
# JSON in a .txt, which a folder read would take for documents, one line each.
_INDEX_CACHE_DESCRIPTION = re.compile(r"[0-9a-f]{32}-\w+-\w+-description\.txt")


# How a skipped kind is named in warnings (default: the field name with '-' for '_').
_LABELS = {"not_object": "not-an-object"}


@dataclass
class ReadStats:
    """Counts of skipped input lines (reported in the manifest and as warnings), and of the inputs opened."""

    files: int = 0  # local files opened, a folder's counted one by one
    datasets: int = 0  # `datasets` names opened (the hub)
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

    def inputs_read(self) -> str:
        """'3 files' / '1 file and 1 Hugging Face dataset': what was read, for the summary line."""
        parts = [f"{n} {what}{'s' if n != 1 else ''}" for n, what in ((self.files, "file"),
                                                                     (self.datasets, "Hugging Face dataset")) if n]
        return " and ".join(parts) or "no input"

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
        name = p.name or p.resolve().name  # `--input .`
        for ext in _LOCAL:
            if name.endswith(ext):
                return name[: -len(ext)]
        return name
    return src.split(":")[0]


def _data_type(name: str) -> str | None:
    """The data file type of a file name ('jsonl' for a.jsonl.gz), or None for a file that is not data."""
    if not name.endswith(_LOCAL) or _INDEX_CACHE_DESCRIPTION.fullmatch(name):
        return None
    return name[: -len(".gz")].rsplit(".", 1)[-1] if name.endswith(".gz") else name.rsplit(".", 1)[-1]


def folder_files(folder: str | Path) -> tuple[list[Path], list[Path]]:
    """(data files, other files) of a folder input, each in sorted path order, searched recursively: see the
    module docstring for what counts as data. DataError when there is no data file, or data files of more than
    one type (the odd ones are likely not data: a README.txt among .jsonl shards, a tokenizer's .json files)."""
    root = Path(folder)
    data: list[Path] = []
    other: list[Path] = []
    walked = {os.path.realpath(root)}  # linked folders are followed (shards linked in), each once: no cycles
    for top, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in sorted(dirs) if not d.startswith((".", "__"))  # .git, __pycache__: as `datasets`
                   and os.path.realpath(os.path.join(top, d)) not in walked]
        walked.update(os.path.realpath(os.path.join(top, d)) for d in dirs)
        for name in names:
            if name.startswith("."):
                continue
            path = Path(top, name)
            kind = _data_type(name)
            if kind == "json" and path.with_suffix(".idx").is_file():  # a prepared dataset's manifest
                kind = None
            (data if kind else other).append(path)
    data.sort(key=str)
    other.sort(key=str)
    if not data:
        held = f"; it holds {_some(other)}" if other else "; it is empty"
        raise DataError(f"--input {folder}: no data files in this folder or its subfolders (types read: "
                        f"{', '.join(_LOCAL)}){held}; give a folder of data files, or the files themselves")
    by_type: dict[str, list[Path]] = {}
    for path in data:
        by_type.setdefault(_data_type(path.name) or "", []).append(path)
    if len(by_type) > 1:
        mix = "; ".join(f"{len(by_type[t])} .{t}: {_some(by_type[t], 2)}"
                        for t in sorted(by_type, key=lambda t: (-len(by_type[t]), t)))
        raise DataError(f"--input {folder}: holds data files of more than one type ({mix}); a folder is read as "
                        "files of one type, as a mix is most often data beside files that are not (a README.txt, a "
                        "tokenizer's .json): give the data files themselves (--input FILE...), or move the others "
                        "out")
    return data, other


def _some(paths: list[Path], show: int = 3) -> str:
    more = f" and {len(paths) - show} more" if len(paths) > show else ""
    return ", ".join(map(str, paths[:show])) + more


def check_inputs(inputs: list[str]) -> None:
    """Fail early (before any output is opened) on inputs that cannot be read, or whose data would be read twice
    (a file given twice, or given and also in a folder given); warn about a folder's files that are not read."""
    if not inputs:
        raise DataError("--input: no input given")
    seen: dict[str, str] = {}  # resolved file or name -> the --input that reads it
    for src in inputs:
        p = Path(src)
        if p.is_dir():
            _once(str(p.resolve()), src, seen)
            files, other = folder_files(p)
            if other:
                print(f"warning: --input {src}: {len(other)} file{'s' if len(other) != 1 else ''} in it not read, "
                      f"as not data: {_some(other)}", file=sys.stderr)
            for path in files:
                _once(str(path.resolve()), src, seen, also=path)
                _check_file(str(path))
            continue
        # the same file under two spellings (a/b.jsonl, ./a/b.jsonl) would be read twice: its documents doubled
        _once(str(p.resolve()) if p.exists() else src, src, seen)
        if p.is_file():
            _check_file(src)
        elif not p.exists():
            looks_local = src.endswith(_LOCAL) or src.startswith((".", "/", "~")) or src.count("/") > 1
            if looks_local:
                raise DataError(f"--input {src}: file not found")


def _once(key: str, src: str, seen: dict[str, str], also: Path | None = None) -> None:
    """DataError when `key` (a resolved path) is already read by an earlier --input."""
    if key not in seen:
        seen[key] = src
        return
    first = seen[key]
    if also is not None:  # a file of folder `src`
        what = f"holds {also}, which --input {first} reads too" if first != src else f"reaches {also} twice"
    elif Path(first).is_dir() and first != src and Path(src).is_file():
        what = f"is in the folder given as --input {first}, which reads it too"
    else:
        what = "given twice" + (f" (also as {first})" if first != src else "")
    raise DataError(f"--input {src}: {what}, so its data would be read twice; drop the repeat "
                    "(cpt weights a source with --upsample SOURCE:all=RATE)")


def _check_file(src: str) -> None:
    if not src.endswith(_LOCAL):
        raise DataError(f"--input {src}: unsupported file type; use one of {', '.join(_LOCAL)}")
    if not src.endswith(".parquet"):
        _check_compression(src)


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
    stats.files += 1
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
    name, _, split = src.partition(":")
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
                msg = str(e).splitlines()[0] if str(e) else ""
                raise DataError(f"--input {src}: reading it with `datasets` failed after {n} rows "
                                f"({type(e).__name__}: {msg})") from None
            n += 1
            yield f"{src}:row {n}", row
    finally:
        json_log.setLevel(level)


def iter_rows(inputs: list[str], stats: ReadStats) -> Iterator[tuple[str, str, dict]]:
    """Yield (input name, location, row dict) over all inputs in order; a folder's rows are its data files' rows
    (`folder_files`), all under the folder's name."""
    for src in inputs:
        p = Path(src)
        name = input_name(src)
        if p.is_dir():
            files = folder_files(p)[0]
        elif p.is_file():
            files = [p]
        else:
            stats.datasets += 1
            for where, row in _rows_hf(src):
                yield name, where, row
            continue
        for path in files:
            for where, row in _rows_local(path, stats):
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
