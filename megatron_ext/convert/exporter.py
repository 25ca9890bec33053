"""Megatron-Core torch_dist checkpoint (saved at any TP/PP) -> HF Llama folder, a layer at a time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megatron_ext.convert import mapping
from megatron_ext.convert.hf_io import (
    DTYPES,
    GENERATION_CONFIG,
    TOKENIZER_FILES,
    VOCABULARY_FILES,
    ConvertError,
    StreamingSafetensorsWriter,
    check_llama,
    copy_tokenizer,
    dtype_name,
    export_config,
    folder_generation_defaults,
    generation_config,
    is_hf_model_folder,
    tokenizer_files,
)
from megatron_ext.convert.dist_reader import TorchDistReader
from megatron_ext.convert.staging import check_out, check_separate, peak_rss_bytes, staged_output
from megatron_ext.hf_config import normalize_hf_config
from megatron_ext.progress import progress_bar

# Checkpoint keys that are not weights: TE/local `_extra_state` objects, optimizer state.
_NOT_WEIGHTS = ("optimizer.",)


def megatron_shapes(cfg: dict, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Global torch_dist shape of every model key of an HF config (normalised)."""
    h, f, d, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    nh, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {
        "embedding.word_embeddings.weight": (padded_vocab, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (n, h),
        "decoder.layers.self_attention.linear_qkv.weight": (n, (nh + 2 * ng) * d, h),
        "decoder.layers.self_attention.linear_proj.weight": (n, h, nh * d),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (n, h),
        "decoder.layers.mlp.linear_fc1.weight": (n, 2 * f, h),
        "decoder.layers.mlp.linear_fc2.weight": (n, h, f),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (padded_vocab, h),
    }
    return {e.megatron: shapes[e.megatron] for e in mapping.entries(cfg["tie_word_embeddings"])}


def check_stored(reader: TorchDistReader, cfg: dict, path: Path) -> None:
    """Every table key present with the config's shape (any vocab padding), no unknown weight keys."""
    expected = megatron_shapes(cfg, 0)
    weights = {k for k in reader.tensors if not k.startswith(_NOT_WEIGHTS) and "._extra_state" not in k}
    missing = sorted(set(expected) - weights)
    leftover = sorted(weights - set(expected))
    if missing or leftover:
        raise ConvertError(f"{path}: checkpoint keys do not match a Llama model of its hf_config "
                           f"(tie_word_embeddings={cfg['tie_word_embeddings']}): missing {missing or 'none'}, "
                           f"unexpected {leftover[:6] or 'none'}")
    for key, shape in expected.items():
        got = reader.shape(key)
        # embedding rows: vocab_size plus any padding
        vocab = mapping.entry_for_key(key).kind == "vocab"
        vocab_ok = vocab and got[1:] == shape[1:] and got[0] >= cfg["vocab_size"]
        if got != shape and not vocab_ok:
            # a vocab tensor's expected shape has 0 rows (any padding): name the row count it needs instead
            implied = f"[>= {cfg['vocab_size']}, {', '.join(map(str, shape[1:]))}] (vocab_size {cfg['vocab_size']} " \
                "plus any padding)" if vocab else str(list(shape))
            raise ConvertError(f"{path}: {key} has shape {list(got)}, but the metadata hf_config implies "
                               f"{implied}; the metadata does not describe these weights")


def _check_tokenizer(tokenizer: str | Path | None) -> None:
    """--tokenizer names a folder with a tokenizer that transformers loads (checked before the work)."""
    if tokenizer is None:
        return
    tokenizer = Path(tokenizer)
    if tokenizer.is_file():
        raise ConvertError(f"--tokenizer {tokenizer} is a file; give its folder: --tokenizer {tokenizer.parent}")
    if not tokenizer.exists():
        raise ConvertError(f"--tokenizer {tokenizer} does not exist; give the folder of the model's tokenizer, or "
                           "leave --tokenizer out for the one recorded at import")
    fix = "give the folder of the model's tokenizer, or leave --tokenizer out for the one recorded at import"
    files = tokenizer_files(tokenizer)
    if not files:
        raise ConvertError(f"--tokenizer {tokenizer}: no tokenizer files there ({', '.join(TOKENIZER_FILES)}); {fix}")
    # tokenizer_config.json alone (a copy without its vocabulary) was copied and the export called fine, unusable
    if not set(VOCABULARY_FILES) & {f.name for f in files}:
        raise ConvertError(f"--tokenizer {tokenizer}: no tokenizer.json (or sentencepiece tokenizer.model) there, "
                           f"only {', '.join(f.name for f in files)}, settings without the vocabulary (a Llama-3.1 "
                           f"folder has tokenizer.json); {fix}")
    try:  # a damaged file, or a tokenizer.model without sentencepiece installed: only loading it tells
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; the CLI prints one line
        reason = " ".join(str(e).split())[:300]
        raise ConvertError(f"--tokenizer {tokenizer}: transformers cannot load the tokenizer there "
                           f"({type(e).__name__}: {reason}); {fix}") from None


def _rope_of(cfg: dict) -> tuple:
    """What the rope computes, with transformers' defaults filled in (an implicit and an explicit
    original_max_position_embeddings of the same value are the same rope)."""
    from megatron_ext.rope_spec import rope_spec

    spec = rope_spec(cfg)
    return spec.rope_type, spec.theta, spec.dim, spec.params


def to_hf(megatron_dir: str | Path, out: str | Path, *, iteration: int | None = None, rope_preset: str | None = None,
          max_position_embeddings: int | None = None, dtype: str | None = None, tokenizer: str | Path | None = None,
          verify: bool = False, force: bool = False, tolerance: float = 1e-4, max_shard_bytes: int = 5 * 2**30,
          progress: bool = True, rope_differs_ok: bool | None = None) -> dict:
    """Export a Megatron checkpoint root to an HF Llama folder `out`. Returns a report dict.

    A `rope_preset` whose rope differs from the one the checkpoint was trained with: with `rope_differs_ok=False`
    (tools/convert.py without --rope-preset-differs-ok) a ConvertError naming both, before anything is written;
    True exports it (`--verify` then checks the weights under the exported rope); None (the default of library
    callers) exports it and, like True, reports it as `rope_changed`, but `--verify` compares with the
    checkpoint's own rope (and fails, the logits differing).
    """
    from megatron_ext.checkpoint_index import CheckpointError
    from megatron_ext.checkpoint_layout import read_metadata, resolve_iteration_dir

    start = time.time()
    out = Path(out)
    if rope_preset is not None and max_position_embeddings is not None:
        raise ConvertError("pass either --rope-preset or --max-position-embeddings, not both")
    if max_shard_bytes < 1:
        raise ConvertError(f"max_shard_bytes = {max_shard_bytes}: must be positive (--max-shard-size-gb, e.g. 5)")
    if iteration is not None and (isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0):
        raise ConvertError(f"--iteration {iteration}: an iteration is a training step number >= 0 (the N of the "
                           "checkpoint's iter_N folders); leave it out for the latest")
    check_separate(out, Path(megatron_dir), "--megatron")
    _check_tokenizer(tokenizer)
    if is_hf_model_folder(Path(megatron_dir)):
        raise ConvertError(f"--megatron {megatron_dir} is a Hugging Face model folder (config.json), not a Megatron "
                           f"checkpoint; to convert it: python tools/convert.py to-megatron --hf {megatron_dir} "
                           "--out CKPT_DIR")
    check_out(out, force, "hf")
    try:
        iteration, path = resolve_iteration_dir(megatron_dir, iteration)
        meta = read_metadata(path)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None
    if "hf_config" not in meta:
        raise ConvertError(f"{path}: metadata has no hf_config; cannot tell the architecture")
    check_llama(meta["hf_config"], f"{path} metadata hf_config")
    cfg = normalize_hf_config(meta["hf_config"])
    reader = TorchDistReader(path)
    check_stored(reader, cfg, path)
    if dtype is not None:
        target = DTYPES[dtype]
    else:
        target = DTYPES.get((meta.get("source") or {}).get("dtype", ""), reader.dtype("embedding.word_embeddings.weight"))
    hf_cfg = export_config(cfg, target, rope_preset, max_position_embeddings)
    rope_changed = None
    if _rope_of(hf_cfg) != _rope_of(cfg):  # only --rope-preset changes it (--max-position-embeddings keeps it)
        rope_changed = (f"exported rope {hf_cfg['rope_scaling']} (theta {hf_cfg['rope_theta']}) differs from the "
                        f"checkpoint's {cfg['rope_scaling']} (theta {cfg['rope_theta']})")
        if rope_differs_ok is False and rope_preset is not None:
            raise ConvertError(f"--rope-preset {rope_preset}: its rope {hf_cfg['rope_scaling']} (theta "
                               f"{hf_cfg['rope_theta']}) differs from the rope {path} was trained with "
                               f"{cfg['rope_scaling']} (theta {cfg['rope_theta']}), which its weights know; leave "
                               "--rope-preset out to export the checkpoint's own rope, or pass "
                               "--rope-preset-differs-ok to declare this one anyway (e.g. to evaluate a base model "
                               "with an UltraLong rope it was not trained with)")

    table = mapping.entries(cfg["tie_word_embeddings"])
    head = [e for e in table if not e.per_layer and e.megatron.startswith("embedding")]
    tail = [e for e in table if not e.per_layer and not e.megatron.startswith("embedding")]
    per_layer = [e for e in table if e.per_layer]
    steps = [(head, None)] + [(per_layer, i) for i in range(cfg["num_hidden_layers"])] + [(tail, None)]
    written: list[str] = []
    with staged_output(out, force, "hf") as tmp:
        shapes = mapping.hf_shapes(cfg)
        plan = [(n, shapes[n], target) for group, layer in steps for e in group for n in e.hf_names(layer)]
        writer = StreamingSafetensorsWriter(tmp, plan, max_shard_bytes)
        for group, layer in progress_bar(steps, desc="megatron -> hf", unit="step", enabled=progress):
            tensors = reader.read([e.megatron for e in group], layer)
            for e in group:
                for name, t in zip(e.hf_names(layer), mapping.to_hf(e, tensors[e.megatron], cfg)):
                    t = t.to(target)
                    if not torch.isfinite(t).all():  # NaN in the checkpoint, or beyond fp16's range (65504)
                        raise ConvertError(f"{path}: {e.megatron} holds NaN or Inf values as {dtype_name(target)} "
                                           f"(HF {name}): a diverged run, or beyond the range of --dtype; nothing "
                                           "written (--dtype bf16 keeps fp32's range)")
                    writer.add(name, t)
                    written.append(name)
        writer.close()
        left = sorted(set(mapping.expected_hf_names(cfg)) - set(written))
        if left:
            raise ConvertError(f"HF tensors not produced by the mapping: {', '.join(left[:6])}")
        gen = meta.get("generation_config")
        if tokenizer is not None:  # the model folder a run started from, for checkpoints that record neither
            folder_gen, folder_ids = folder_generation_defaults(Path(tokenizer))
            gen = gen or folder_gen
            hf_cfg.update({k: v for k, v in folder_ids.items() if hf_cfg.get(k) is None})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        gen = generation_config(hf_cfg, gen)
        (tmp / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
        tok_dir = Path(tokenizer) if tokenizer else (Path(meta["tokenizer"]) if meta.get("tokenizer") else None)
        found = [f.name for f in tokenizer_files(tok_dir)]
        # the recorded folder is not checked before the work as --tokenizer is: its settings without a vocabulary
        # made an export that no tokenizer loads from, said to have its tokenizer
        copied = copy_tokenizer(tok_dir, tmp) if set(VOCABULARY_FILES) & set(found) else []
        report = {"direction": "to-hf", "out": str(out), "iteration": iteration, "dtype": dtype_name(target),
                  "tensors": len(written), "bytes": writer.total, "tokenizer_files": copied}
        if rope_changed:
            report["rope_changed"] = rope_changed
        why = (f"{tok_dir} has {', '.join(found)} but no tokenizer.json or tokenizer.model, the vocabulary" if found
               else f"tokenizer location {tok_dir}")
        warnings = [] if copied else [f"no tokenizer files copied ({why}); pass --tokenizer DIR to include them"]
        if hf_cfg.get("eos_token_id") is None and gen.get("eos_token_id") is None:
            warnings.append("no eos_token_id recorded: transformers would take Llama-2's (2) and generate() would "
                            "not stop at the end of an answer; pass --tokenizer HF_DIR, the model folder the run "
                            "started from (its config.json and generation_config.json give them)")
        if warnings:
            report["warning"] = "; ".join(warnings)
        if verify:
            from megatron_ext.convert.verify import check_rope_far_out, compare_logits

            # the oracle is the checkpoint rounded to the exported dtype (every HF tensor is written in it); with a
            # rope changed on purpose, our model built with the exported rope (the check is of the weights)
            under = hf_cfg if rope_changed and rope_differs_ok else None
            report["max_abs_logit_diff"] = diff = compare_logits(tmp, megatron_dir, iteration, round_megatron=target,
                                                                 megatron_hf_config=under)
            if diff > tolerance:
                why = f" ({rope_changed}: pass --rope-preset-differs-ok to verify the weights under it)" \
                    if rope_changed else ""
                raise ConvertError(f"--verify: max |logit diff| {diff:.3e} > tolerance {tolerance:g} between the "
                                   f"exported model and {path}{why}; nothing written")
            report["rope_checked_at"] = check_rope_far_out(tmp, under or cfg, "the exported config")
    report.update(seconds=round(time.time() - start, 2), peak_rss_bytes=peak_rss_bytes())
    return report
