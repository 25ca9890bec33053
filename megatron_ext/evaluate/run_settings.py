"""The settings an evaluation's results record that decide their prompts and their numbers, and the one-line
refusal (EvalError) of an earlier run's results (--resume) made with other ones: NIAH's and RULER's grids use them
to keep only cells comparable with this run's, perplexity records the engine it ran on.
"""

from __future__ import annotations

import hashlib

from megatron_ext.evaluate.errors import EvalError


def refuse_other_prompts(previous: dict, settings: dict, keys: tuple[str, ...]) -> None:
    """EvalError when an earlier run's results (their `previous` settings) were made with other `keys` than this
    run's `settings`, so other prompts; a haystack file's sha256 counts too where they recorded it (older ones
    have none)."""
    hashed = ("haystack_sha256",) if "haystack_sha256" in previous else ()
    for key in keys + hashed:
        if previous.get(key) != settings.get(key):
            raise EvalError(f"the earlier results were made with {key} = {previous.get(key)!r}, this run "
                            f"has {settings.get(key)!r}: use another --out, or drop --resume")


# Settings that decide the numbers a model computes from the same prompts, with the flag that sets each: a cell of
# another engine, dtype or tokenizer is another measurement, and one grid must not average two. Not compared: the
# device (cpu and cuda at one dtype differ by their kernels alone, as batch sizes and prefill chunks do, which are
# not compared either; `settings.device` is then the last run's) and the Megatron engine's layout (TP, PP and CP give
# the same outputs by design, tests/distributed/test_niah_megatron.py).
_NUMERICS_SETTINGS = {"engine": "--engine", "dtype": "--dtype", "tokenizer_sha256": "--tokenizer"}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # HF runs recorded torch's names


def tokenizer_digest(tokenizer) -> str | None:
    """sha256 of what turns text into ids: the fast tokenizer's full definition (vocabulary, merges, normalizer,
    special tokens; its tokenizer.json as `tokenizers` writes it) and its chat template. The same tokenizer at two
    paths (an HF folder's copy of a checkpoint's) has one digest. None without a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256(backend.to_str().encode("utf-8"))
    h.update(b"\0" + str(getattr(tokenizer, "chat_template", None) or "").encode("utf-8"))
    return h.hexdigest()


def tokenizer_settings(tokenizer) -> dict:
    """The tokenizer's name (as loaded) and digest, for a result's settings."""
    return {"tokenizer": getattr(tokenizer, "name_or_path", None) or None,
            "tokenizer_sha256": tokenizer_digest(tokenizer)}


def engine_settings(model, numerics: dict | None) -> dict:
    """engine, device and dtype of an HF `model` (`hf`), or `numerics` (the Megatron engine's) when given."""
    if numerics is not None:
        return dict(numerics)
    if model is None:
        return {}
    p = next(model.parameters())
    return {"engine": "hf", "device": str(p.device), "dtype": str(p.dtype).replace("torch.", "")}


def refuse_other_numerics(previous: dict, settings: dict) -> None:
    """EvalError, one line, when an earlier run's results (their `previous` settings) were computed with another
    engine (hf / megatron), dtype or tokenizer than this run's `settings`: naming the setting, old -> new, and the
    fix. A setting that either side does not record (results of older versions) is not compared."""
    for key, flag in _NUMERICS_SETTINGS.items():
        old, new = previous.get(key), settings.get(key)
        if old is None or new is None:
            continue
        if key == "dtype":
            old, new = _DTYPE_NAMES.get(old, old), _DTYPE_NAMES.get(new, new)
        if old == new:
            continue
        if key == "tokenizer_sha256":
            was, now = previous.get("tokenizer"), settings.get("tokenizer")
            fix = f"{flag} {was}" if was else "the earlier tokenizer"
            raise EvalError(f"--resume: the earlier cells were tokenized by another tokenizer, {was or '?'} (sha256 "
                            f"{old[:12]}) -> {now or '?'} (sha256 {new[:12]}): resume with {fix}, or use another --out")
        raise EvalError(f"--resume: the earlier cells ran with {key} {old}, this run with {new} ({old} -> {new}): "
                        f"resume with {flag} {old}, or use another --out")
