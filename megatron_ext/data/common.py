"""Shared pieces of data preparation: the user-error type, tokenizer loading, atomic outputs."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1


class DataError(ValueError):
    """A user mistake in data preparation (bad path, field, value); the CLI prints it as one line."""


def load_tokenizer(spec: str, announce: str | None = None) -> Any:
    """Load an HF fast tokenizer from a folder or hub name; DataError when there is none. `announce`: a prefix
    (`cpt`) for a line on stderr before loading, which takes seconds (a hub tokenizer: a download)."""
    if announce:
        print(f"{announce}: loading tokenizer {spec}", file=sys.stderr, flush=True)
    path = Path(spec)
    if path.is_file():  # a tokenizer is a folder of files; the message below said there were none "there"
        fix = (f"give its folder: --tokenizer {path.parent}" if path.name in ("tokenizer.json", "tokenizer_config.json")
               else "pass an HF tokenizer folder (e.g. one written by save_pretrained)")
        raise DataError(f"--tokenizer {spec}: is a file, but --tokenizer takes the folder of a tokenizer; {fix}")
    if path.exists() and not (path.is_dir() and ((path / "tokenizer.json").is_file()
                                                  or (path / "tokenizer_config.json").is_file())):
        raise DataError(f"--tokenizer {spec}: no tokenizer.json / tokenizer_config.json there; "
                        "pass an HF tokenizer folder (e.g. one written by save_pretrained)")
    if not path.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise DataError(f"--tokenizer {spec}: no such folder and not an HF hub name ([owner/]name)")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; report one line
        where = "" if path.exists() else f"no local folder {spec!r}, and as a hub name: "
        offline = "" if path.exists() else ("; without network, pass a local tokenizer folder (HF_HUB_OFFLINE=1 "
                                            "skips the retries; tools/prepare_data.py toy writes an offline one)")
        raise DataError(f"--tokenizer {spec}: cannot load a tokenizer ({where}{type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}){offline}") from None
    if not getattr(tok, "is_fast", False):
        raise DataError(f"--tokenizer {spec}: not a fast (Rust) tokenizer; a tokenizer.json is needed")
    return tok


def tokenizer_hash(tok: Any) -> str:
    """sha256 of the tokenizer's serialized model, normalizer, pre-tokenizer and special tokens."""
    h = hashlib.sha256(tok.backend_tokenizer.to_str().encode("utf-8"))
    return "sha256:" + h.hexdigest()


def vocabulary_hash(tokenizer_json: dict) -> str:
    """sha256 of a tokenizer's vocabulary (`model.vocab` of its tokenizer.json form): the same whether read from
    the file or from the tokenizer transformers loaded from it (which may add tokens and change the post-processor,
    so `tokenizer_hash` of the two can differ), and different for another tokenizer family."""
    text = json.dumps(tokenizer_json["model"]["vocab"], sort_keys=True, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_vocabulary_hash(tok: Any) -> str:
    """`vocabulary_hash` of a loaded (fast) tokenizer."""
    return vocabulary_hash(json.loads(tok.backend_tokenizer.to_str()))


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (halves the .bin), else int32 (Llama-3: 128,256 ids)."""
    return np.uint16 if vocab_size <= 65536 else np.int32


def output_paths(prefix: str, with_lossmask: bool = False) -> list[Path]:
    """The files a dataset PREFIX consists of."""
    names = [prefix + ".bin", prefix + ".idx"]
    if with_lossmask:
        names += [prefix + "_lossmask.bin", prefix + "_lossmask.idx"]
    return [Path(n) for n in names] + [Path(prefix + ".json")]


def check_outputs(prefix: str, force: bool, with_lossmask: bool = False, inputs: list[str] | tuple[str, ...] = ()
                  ) -> None:
    """Refuse to overwrite an existing dataset without --force; the output folder must exist; no output file may
    be a file of `inputs` (the --input values), with or without --force.

    PREFIX names files, not a folder: 'out/' or an existing folder would write hidden 'out/.bin' etc.
    """
    if prefix.endswith(("/", os.sep)) or os.path.basename(prefix) in ("", ".", "..") or Path(prefix).is_dir():
        files = "PREFIX.bin/.idx" + (", PREFIX_lossmask.bin/.idx" if with_lossmask else "") + " and PREFIX.json"
        example = os.path.join(os.path.normpath(prefix), "sft" if with_lossmask else "cpt")
        if not prefix:
            raise DataError(f"--output '': empty; --output is a file prefix (it writes {files}), e.g. "
                            f"--output data/{os.path.basename(example)}")
        raise DataError(f"--output {prefix}: is a folder, but --output is a file prefix (it writes {files}); "
                        f"name the files inside it, e.g. --output {example}")
    parent = Path(prefix).parent
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists() or p.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():  # `afile/a` said "folder afile does not exist"
            what = (f"a link to {os.readlink(blocker)}, which does not exist" if not blocker.exists()
                    else "a file, not a folder")
            raise DataError(f"--output {prefix}: {blocker} is {what}; put the prefix in a folder (mkdir DIR, then "
                            f"--output DIR/{os.path.basename(prefix)})")
        raise DataError(f"--output {prefix}: folder {parent} does not exist; create it first")
    from megatron_ext.cli_types import folder_write_problem

    problem = folder_write_problem(parent)
    if problem:  # found now, not as a traceback from the first write after the tokenizer and a read of the inputs
        raise DataError(f"--output {prefix}: {problem}")
    _refuse_inputs_as_outputs(prefix, with_lossmask, inputs)  # before "pass --force", which destroyed the input
    existing = [str(p) for p in output_paths(prefix, with_lossmask) if p.exists()]
    if existing and not force:
        raise DataError(f"--output {prefix}: {existing[0]} already exists; pass --force to overwrite "
                        "or choose another prefix")


def _real_path(path: str | Path) -> str:
    """`path` with its folders' links resolved but not its own name: the file a rename onto `path` replaces (a
    link named like an output is replaced as a link; the file it points to survives)."""
    path = Path(path)
    return os.path.join(os.path.realpath(path.parent), path.name)


def _refuse_inputs_as_outputs(prefix: str, with_lossmask: bool, inputs: list[str] | tuple[str, ...]) -> None:
    """DataError when an output file of PREFIX is a file an --input reads (the file itself, one in an input folder,
    or one an input links to): `--input corpus.json --output corpus` replaced the corpus with the manifest."""
    from megatron_ext.data.sources import folder_files

    outputs = {_real_path(p): p for p in output_paths(prefix, with_lossmask)}
    for src in inputs:
        path = Path(src)
        if path.is_dir():
            try:
                files = folder_files(path)[0]
            except DataError:  # no data in it: check_inputs says so; nothing of it is read
                continue
        else:
            files = [path]
        for file in files:
            clash = outputs.get(os.path.realpath(file)) if file.exists() else None
            if clash is not None:
                held = (f" (which holds {file})" if str(file) != src
                        else " (a link to it)" if file.is_symlink() else "")
                kind = "sft" if with_lossmask else "cpt"
                raise DataError(f"--output {prefix}: would overwrite {clash}, which --input {src}{held} reads; "
                                f"give another --output prefix, e.g. --output {prefix}_{kind}")


@contextmanager
def atomic_outputs(prefix: str, with_lossmask: bool = False) -> Iterator[dict[str, str]]:
    """Yield temporary names for the PREFIX files; rename all into place only if the block succeeds.

    On any exception the temporaries are deleted, so no partial .bin/.idx is ever left behind.
    The manifest (.json) is renamed last: its presence marks a complete dataset.
    """
    tag = f".tmp{os.getpid()}"
    final = output_paths(prefix, with_lossmask)
    tmp = {str(p): str(p) + tag for p in final}
    try:
        yield tmp
    except BaseException:
        for t in tmp.values():
            Path(t).unlink(missing_ok=True)
        raise
    # An older dataset under these names (--force) loses its manifest first: killed between the renames, the new
    # .bin beside the old .idx must not look complete.
    final[-1].unlink(missing_ok=True)
    try:
        for dst in final:  # json last
            os.replace(tmp[str(dst)], dst)
    except BaseException:  # a rename that fails (or a Ctrl-C between two) leaves no temporary behind either
        for t in tmp.values():
            Path(t).unlink(missing_ok=True)
        raise


def write_json(path: str, obj: dict) -> None:
    """Deterministic JSON (sorted keys, fixed indent) so identical inputs give identical bytes."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def length_histogram(lengths: np.ndarray) -> dict[str, int]:
    """Document counts per power-of-two token-length bin, keyed '[lo, hi)' (pure, exact)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    hist: dict[str, int] = {}
    if lengths.size == 0:
        return hist
    bins = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    for b, c in zip(*np.unique(bins, return_counts=True)):
        hist[f"[{2 ** int(b)}, {2 ** (int(b) + 1)})"] = int(c)
    return hist


def split_fractions(split: str) -> tuple[float, float, float]:
    """`data.split` ("98,2,0", "98/2/0"; missing weights are 0) as train/valid/test fractions summing to 1.

    DataError (naming data.split) unless it is 1 to 3 non-negative numbers with a positive train weight.
    """
    parts = [s.strip() for s in split.replace("/", ",").split(",")]
    try:
        weights = [float(s) for s in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not w >= 0 for w in weights) or weights[0] <= 0:
        raise DataError(f"data.split = {split!r}: expected train,valid,test weights such as '98,2,0' "
                        "(non-negative numbers, the train weight above 0)")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def split_range(num_documents: int, split: str, part: int) -> range:
    """Documents of split `part` (0 train, 1 valid, 2 test): consecutive ranges in document order, bounded
    as Megatron-Core's GPTDataset bounds its splits (round(cumulative fraction x documents)), so CPT and SFT
    data split alike."""
    fractions = split_fractions(split)
    begin = sum(fractions[:part])
    return range(int(round(begin * num_documents)), int(round((begin + fractions[part]) * num_documents)))
