"""The model and tokenizer a `tools/niah.py` command names (--model, --megatron, --tokenizer): the loaded pair (a
--megatron checkpoint converted to HF in a temporary folder), and what the checks before the model loads read
early (the tokenizer, the vocabulary size, a checkpoint's run metadata).
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from megatron_ext.evaluate.errors import EvalError
from megatron_ext.log_lines import log_line


@contextmanager
def model_and_tokenizer(args, tokenizer=None):
    """(model, tokenizer) from --model or --megatron (converted into a temporary directory under --out, removed
    on errors, Ctrl-C and SIGTERM too), with --tokenizer's tokenizer when given. `tokenizer`: the one
    `early_tokenizer` loaded, not loaded again."""
    from megatron_ext.evaluate.loading import check_convertible, check_vocab, convert_megatron, load_hf, load_tokenizer

    if args.model is not None:
        given = tokenizer
        if given is None and args.tokenizer is not None:
            given = load_tokenizer(args.tokenizer, f"--tokenizer {args.tokenizer}", _TOKENIZER_FIX)
        model, tokenizer = load_hf(args.model, args.device, args.dtype, given)
        check_vocab(tokenizer, model.config.vocab_size,
                    f"--tokenizer {args.tokenizer}" if args.tokenizer is not None else f"the tokenizer in {args.model}")
        yield model, tokenizer
        return
    # Before the conversion, which copies the whole model: a missing tokenizer is found in seconds, and an HF
    # folder or a missing path before "converting ..." is printed.
    check_convertible(args.megatron)
    if tokenizer is None:
        tokenizer = _megatron_tokenizer(args)
    made = args.out is not None and not args.out.exists()
    if args.out is not None:  # beside the results: the same file system, removed with the directory
        args.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=args.out, prefix=".hf-from-megatron.") as tmp:
            log_line(f"[niah] converting {args.megatron} to Hugging Face format (tools/convert.py to-hf)", sys.stderr)
            yield load_hf(convert_megatron(args.megatron, Path(tmp) / "hf"), args.device, args.dtype, tokenizer)
    finally:
        if made and not any(args.out.iterdir()):  # a failed conversion leaves no empty --out behind
            args.out.rmdir()


_TOKENIZER_FIX = "give a tokenizer directory (tokenizer.json ...) or a hub name"


def early_tokenizer(args):
    """The tokenizer the run will use, loaded before the model (seconds, where the model takes minutes) for checks
    that need it: --tokenizer's, --model's own, or the one --megatron's checkpoint records. None when the folder
    is not there or not a checkpoint: loading the model then says so, with the message it always gave."""
    from megatron_ext.evaluate.loading import load_tokenizer, model_tokenizer

    if args.model is None:
        return _megatron_tokenizer(args)
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer, f"--tokenizer {args.tokenizer}", _TOKENIZER_FIX)
    if (args.model / "config.json").is_file():  # as load_hf loads it
        return model_tokenizer(args.model)
    return None


def _megatron_tokenizer(args):
    """--tokenizer's or the tokenizer --megatron's checkpoint records (which tools/convert.py to-hf would copy);
    None when the checkpoint's metadata cannot be read: the converter then says what is wrong with it."""
    from megatron_ext.evaluate.loading import megatron_tokenizer

    meta = _checkpoint_metadata(args)
    if meta is None:
        return None
    return megatron_tokenizer(args.megatron, args.tokenizer, meta.get("tokenizer"),
                              (meta.get("hf_config") or {}).get("vocab_size"))


def _checkpoint_metadata(args) -> dict | None:
    """The run metadata of --megatron's checkpoint; None when it cannot be read (the converter or the engine then
    says why)."""
    from megatron_ext.checkpoint_index import CheckpointError
    from megatron_ext.checkpoint_layout import read_metadata

    try:
        meta = read_metadata(args.megatron)
    except (CheckpointError, OSError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def data_tokenizer(args):
    """(tokenizer, where it comes from) of the model, for checking ppl --indexed data against (before the model
    loads): --tokenizer's, --model's own or the one --megatron's checkpoint records; (None, None) when there is
    none to compare. The Megatron engine reads token ids alone and runs without one, so a tokenizer it cannot load
    is not compared there; the transformers engine needs it, and says so here."""
    if args.model is not None:
        return early_tokenizer(args), args.tokenizer or str(args.model)
    try:
        tokenizer = _megatron_tokenizer(args)
    except EvalError:
        if args.engine == "hf":
            raise
        return None, None
    return tokenizer, args.tokenizer or (_checkpoint_metadata(args) or {}).get("tokenizer")


def model_vocab_size(args) -> int | None:
    """vocab_size from --model's config.json or --megatron's run metadata, read before the model is loaded; None
    when unreadable (loading the model then says what is wrong)."""
    from megatron_ext.checkpoint_index import CheckpointError
    from megatron_ext.checkpoint_layout import read_metadata
    from megatron_ext.hf_config import read_config_json

    try:
        cfg = read_config_json(args.model / "config.json") if args.model else read_metadata(args.megatron)["hf_config"]
        return int(cfg["vocab_size"])
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None
