"""HF Llama safetensors -> Megatron-Core torch_dist checkpoint (iteration 0), streamed tensor by tensor."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from megatron_ext.convert import mapping
from megatron_ext.convert.hf_io import (
    GENERATION_CONFIG,
    ConvertError,
    SafetensorsReader,
    dtype_name,
    read_hf_config,
    source_dtype,
    tokenizer_files,
)
from megatron_ext.convert.staging import ensure_cpu_process_group, peak_rss_bytes, staged_output

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def check_hf_tensors(reader: SafetensorsReader, cfg: dict) -> None:
    """Every expected HF tensor present with its config shape, nothing unexpected left over."""
    expected = mapping.hf_shapes(cfg)
    present = set(reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        hint = " (lm_head.weight is required because tie_word_embeddings is false)" \
            if "lm_head.weight" in missing else ""
        raise ConvertError(f"{reader.dir}: {len(missing)} tensors missing{hint}: {', '.join(missing[:6])}"
                           + (" ..." if len(missing) > 6 else ""))
    allowed = set(expected) | ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    leftover = sorted(n for n in present - allowed if not n.endswith(mapping.HF_IGNORED_SUFFIXES))
    if leftover:
        raise ConvertError(f"{reader.dir}: {len(leftover)} tensors have no place in a Llama model of this config "
                           f"(num_hidden_layers={cfg['num_hidden_layers']}): {', '.join(leftover[:6])}"
                           + (" ..." if len(leftover) > 6 else ""))
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ConvertError(f"{reader.dir}: {name} has shape {list(reader.shape(name))} but config.json implies "
                               f"{list(shape)}; config.json and the weights do not belong together")


def fill_model(model, reader: SafetensorsReader, cfg: dict, padded_vocab: int, progress: bool = True) -> None:
    """Copy HF tensors into a TP=1, PP=1 Megatron model through its sharded state dict (checkpoint keys)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from tqdm import tqdm

    items = [(name, sh) for name, sh in model.sharded_state_dict().items()
             if isinstance(sh, (ShardedTensor, ShardedTensorFactory))]
    consumed: set[str] = set()
    with torch.no_grad():
        for name, sh in tqdm(items, desc="hf -> megatron", unit="tensor", disable=not progress):
            try:
                entry = mapping.entry_for_key(sh.key)
            except KeyError:
                raise ConvertError(f"model tensor {sh.key} has no entry in the mapping table") from None
            m = _LAYER.match(name)
            layer = int(m.group(1)) if m else None
            names = entry.hf_names(layer)
            t = mapping.to_megatron(entry, [reader.get(n) for n in names], cfg, padded_vocab)
            if tuple(t.shape) != tuple(sh.data.shape):
                raise ConvertError(f"{names[0]}: converted shape {list(t.shape)} != model {list(sh.data.shape)}")
            sh.data.copy_(t)
            consumed.update(names)
    if cfg["tie_word_embeddings"] and "lm_head.weight" in reader.names():
        # transformers ignores a stored lm_head when tied; it must then equal the embedding
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise ConvertError(f"{reader.dir}: tie_word_embeddings is true but lm_head.weight differs from "
                               "model.embed_tokens.weight; set tie_word_embeddings=false in config.json")
        consumed.add("lm_head.weight")
    left = sorted(set(mapping.expected_hf_names(cfg)) - consumed)
    if left:
        raise ConvertError(f"HF tensors not consumed by the mapping: {', '.join(left[:6])}")


def to_megatron(hf_dir: str | Path, out: str | Path, *, dtype: str | None = None, verify: bool = False,
                force: bool = False, make_vocab_size_divisible_by: int = 128, tolerance: float = 1e-4,
                progress: bool = True) -> dict:
    """Convert an HF Llama folder into a Megatron checkpoint root `out` (iteration 0). Returns a report dict."""
    from megatron_ext.checkpoint import save_checkpoint
    from megatron_ext.model import BuildOptions, build_model, padded_vocab_size

    start = time.time()
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = read_hf_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    check_hf_tensors(reader, cfg)
    target = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[dtype]
    if target is None:
        target = torch.float32 if source_dtype(cfg) == torch.float32 else torch.bfloat16
    padded = padded_vocab_size(cfg["vocab_size"], make_vocab_size_divisible_by, 1)
    ensure_cpu_process_group()
    with staged_output(out, force) as tmp:
        opts = BuildOptions(device="cpu", precision="bf16" if target == torch.bfloat16 else "fp32",
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by, seq_length=128)
        try:
            model = build_model(cfg, opts)
        except NotImplementedError as e:
            raise ConvertError(f"{hf_dir / 'config.json'}: {e}") from None
        fill_model(model, reader, cfg, padded, progress)
        gen = hf_dir / GENERATION_CONFIG
        metadata = {
            "hf_config": cfg,
            "tokenizer": str(hf_dir.resolve()) if tokenizer_files(hf_dir) else None,
            "generation_config": json.loads(gen.read_text()) if gen.is_file() else None,
            "vocab": {"size": cfg["vocab_size"], "padded": padded,
                      "make_vocab_size_divisible_by": make_vocab_size_divisible_by},
            "source": {"hf_dir": str(hf_dir.resolve()), "dtype": dtype_name(source_dtype(cfg))},
            "converted_by": "megatron_ext.convert.importer",
        }
        save_checkpoint(tmp, 0, [model], metadata=metadata)
        del model
        report = {"direction": "to-megatron", "out": str(out), "dtype": dtype_name(target)}
        if verify:
            from megatron_ext.convert.verify import compare_logits

            report["max_abs_logit_diff"] = diff = compare_logits(hf_dir, tmp)
            if diff > tolerance:
                raise ConvertError(f"--verify: max |logit diff| {diff:.3e} > tolerance {tolerance:g}; "
                                   f"conversion of {hf_dir} is wrong, nothing written")
    report.update(seconds=round(time.time() - start, 2), peak_rss_bytes=peak_rss_bytes())
    return report
