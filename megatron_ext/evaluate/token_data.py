"""Whether a prepared dataset PREFIX holds what perplexity by position (`niah.py ppl --indexed`) and the FP8
calibration (`quantize.py --calib`) read from it: documents of CPT tokens made by the model's tokenizer.

Both read any Megatron indexed dataset as token ids, so an SFT dataset (packed chats), the 0/1 values of its
loss mask, or tokens of another tokenizer whose ids stay below the model's vocab_size ran to a plausible number
and exit 0. The manifest (PREFIX.json, `tools/prepare_data.py`) says the kind and the vocabulary's sha256, which
the trainer compares too (`train_setup.check_data`); a dataset without one (another pipeline's) is taken as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

def model_vocabulary_hash(tokenizer: Any) -> str | None:
    """The manifests' `vocabulary_hash` of a loaded tokenizer; None for one without a fast (Rust) backend or
    with no vocabulary of that form, which then is not compared."""
    from megatron_ext.data.common import tokenizer_vocabulary_hash

    try:
        return tokenizer_vocabulary_hash(tokenizer)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def token_data_problem(prefix: str, flag: str, tokenizer: Any = None, tokenizer_name: str | None = None) -> str | None:
    """Why PREFIX (complete .bin/.idx, checked by the caller) is not CPT tokens of `tokenizer`, as a message that
    starts with `flag` and ends with the fix; None when nothing is wrong, or nothing can be told (no manifest).
    `tokenizer_name`: where the model's tokenizer comes from (the folder or hub name prepare_data.py takes)."""
    from megatron_ext.data import DataError
    from megatron_ext.data.dataset_files import loss_mask_owner, read_manifest

    owner = loss_mask_owner(prefix)
    if owner is not None:
        return (f"{flag} {prefix} is the loss mask of the SFT dataset {owner}, not tokens; give a CPT prefix "
                "(tools/prepare_data.py cpt)")
    if not Path(prefix + ".json").is_file():
        return None
    try:
        manifest = read_manifest(prefix)
    except DataError as e:
        return f"{flag}: {e}"
    if manifest["kind"] != "cpt":
        return (f"{flag} {prefix} is an SFT dataset (manifest kind {manifest['kind']!r}); give a CPT prefix "
                "(tools/prepare_data.py cpt)")
    recorded, ours = manifest.get("vocabulary_hash"), model_vocabulary_hash(tokenizer) if tokenizer is not None else None
    if isinstance(recorded, str) and ours and recorded != ours:
        name = tokenizer_name or "the model's tokenizer"
        return (f"{flag} {prefix} was tokenized with another tokenizer ({manifest.get('tokenizer')}, vocabulary "
                f"{_short(recorded)}) than the model's ({name}, vocabulary {_short(ours)}); prepare it again with "
                f"--tokenizer {name} (tools/prepare_data.py cpt)")
    return None


def _short(digest: str) -> str:
    """'sha256:' and the first 12 hex digits: enough to tell two vocabularies apart in a message."""
    return digest[: len("sha256:") + 12]
