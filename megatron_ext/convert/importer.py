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
from megatron_ext.convert.staging import (
    check_out,
    check_separate,
    ensure_cpu_process_group,
    peak_rss_bytes,
    staged_output,
)
from megatron_ext.progress import progress_bar

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


def _skeleton(cfg: dict, precision: str, divisible: int) -> dict:
    """Sharded state dict of a narrow model with `cfg`'s layer count and embedding tying (TP=1, PP=1).

    Its keys, layer offsets, per-key dtypes and `_extra_state` objects are what a model of `cfg` saves
    and loads; widths do not change them. Building the real model would hold its random init in memory
    beside the converted tensors (2x the model size), so we build this one and swap in real tensors.
    """
    from megatron_ext.model import BuildOptions, build_model

    narrow = {k: cfg[k] for k in ("num_hidden_layers", "tie_word_embeddings", "rms_norm_eps")}
    narrow.update(hidden_size=8, intermediate_size=8, num_attention_heads=2, head_dim=4, vocab_size=divisible,
                  num_key_value_heads=1 if cfg["num_key_value_heads"] < cfg["num_attention_heads"] else 2,
                  rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128)
    model = build_model(narrow, BuildOptions(device="cpu", precision=precision,
                                             make_vocab_size_divisible_by=divisible, seq_length=16))
    return model.sharded_state_dict()


MAX_TP_PIECES = 8  # one node's GPUs; Llama-3.1's 8 KV heads allow no larger TP


def tp_piece_count(cfg: dict) -> int:
    """How many pieces a TP-split tensor is saved in: the largest power of two up to MAX_TP_PIECES that divides the
    KV heads (whole KV groups per piece) and the MLP width. A load at any TP dividing it then reads exactly its
    own pieces; one piece per tensor had every TP rank read (and deserialize) the whole tensor to keep 1/TP of it."""
    n = MAX_TP_PIECES
    while n > 1 and (cfg["num_key_value_heads"] % n or cfg["intermediate_size"] % n):
        n //= 2
    return n


def tp_pieces(entry, t: torch.Tensor, pieces: int, prepend: int) -> list[tuple[torch.Tensor, tuple]]:
    """`t` (the whole tensor, Megatron layout) in pieces along its TP axis, each with its `from_rank_offsets` axis
    fragment: `pieces` of them (fc1: of each SwiGLU half, as Megatron's factory splits them); one if replicated."""
    if entry.tp_axis is None or pieces == 1:
        return [(t, ())]
    count = pieces * (2 if entry.kind == "gate_up" else 1)
    axis = entry.tp_axis
    while count > 1 and t.shape[axis] % count:  # equal pieces only (a vocabulary padded to an odd multiple)
        count //= 2
    return [(chunk.contiguous(), ((prepend + axis, j, count),)) for j, chunk in enumerate(torch.chunk(t, count, axis))]


def build_state(reader: SafetensorsReader, cfg: dict, precision: str, divisible: int,
                progress: bool = True) -> dict:
    """The torch_dist sharded state dict of the HF model: every table entry, layer by layer, real tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_ext.convert.exporter import megatron_shapes
    from megatron_ext.model import padded_vocab_size

    padded = padded_vocab_size(cfg["vocab_size"], divisible, 1)
    shapes = megatron_shapes(cfg, padded)
    layers = cfg["num_hidden_layers"]
    pieces = tp_piece_count(cfg)
    state = _skeleton(cfg, precision, divisible)
    consumed: set[str] = set()
    todo = [(name, sh) for name, sh in state.items() if isinstance(sh, (ShardedTensor, ShardedTensorFactory))]
    for name, sh in progress_bar(todo, desc="hf -> megatron", unit="tensor", enabled=progress):
        try:
            entry = mapping.entry_for_key(sh.key)
        except KeyError:
            raise ConvertError(f"model tensor {sh.key} has no entry in the mapping table") from None
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        names = entry.hf_names(layer)
        dtype = sh.data.dtype  # what the model keeps this tensor in (norms stay fp32 in a bf16 model)
        t = mapping.to_megatron(entry, [reader.get(n) for n in names], cfg, padded).to(dtype).contiguous()
        want = shapes[sh.key][1:] if entry.per_layer else shapes[sh.key]
        if tuple(t.shape) != tuple(want):
            raise ConvertError(f"{names[0]}: converted shape {list(t.shape)} != expected {list(want)}")
        layer_axis = ((0, layer, layers),) if entry.per_layer else ()
        state[name] = [ShardedTensor.from_rank_offsets(sh.key, piece, *layer_axis, *offsets, replica_id=0,
                                                       prepend_axis_num=len(layer_axis))
                       for piece, offsets in tp_pieces(entry, t, pieces, len(layer_axis))]
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
    return state


def to_megatron(hf_dir: str | Path, out: str | Path, *, dtype: str | None = None, verify: bool = False,
                force: bool = False, make_vocab_size_divisible_by: int = 128, tolerance: float = 1e-4,
                progress: bool = True) -> dict:
    """Convert an HF Llama folder into a Megatron checkpoint root `out` (iteration 0). Returns a report dict."""
    from megatron_ext.checkpoint import save_sharded_state
    from megatron_ext.model import padded_vocab_size

    start = time.time()
    hf_dir, out = Path(hf_dir), Path(out)
    if isinstance(make_vocab_size_divisible_by, bool) or not isinstance(make_vocab_size_divisible_by, int) \
            or make_vocab_size_divisible_by < 1:
        raise ConvertError(f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by}: must be a positive "
                           "integer (128, the default, matches the trainer)")
    check_separate(out, hf_dir, "--hf")
    cfg = read_hf_config(hf_dir)
    check_out(out, force, "megatron")
    reader = SafetensorsReader(hf_dir)
    check_hf_tensors(reader, cfg)
    target = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[dtype]
    if target is None:  # fp16 (Llama-2's releases) in fp32: lossless, where bf16 drops 3 bits of each weight
        target = torch.float32 if source_dtype(cfg) in (torch.float32, torch.float16) else torch.bfloat16
    padded = padded_vocab_size(cfg["vocab_size"], make_vocab_size_divisible_by, 1)
    ensure_cpu_process_group()
    with staged_output(out, force, "megatron") as tmp:
        precision = "bf16" if target == torch.bfloat16 else "fp32"
        state = build_state(reader, cfg, precision, make_vocab_size_divisible_by, progress)
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
        save_sharded_state(tmp, 0, {"model": state}, metadata=metadata)
        del state
        report = {"direction": "to-megatron", "out": str(out), "dtype": dtype_name(target)}
        if verify:
            from megatron_ext.checkpoint_layout import iter_dir_name
            from megatron_ext.convert.verify import check_rope_far_out, compare_logits, stored_hf_dtypes

            # the oracle is the source rounded to what was stored (bf16 of an fp32 model is not a mapping error)
            stored = stored_hf_dtypes(tmp / iter_dir_name(0), cfg)
            report["max_abs_logit_diff"] = diff = compare_logits(hf_dir, tmp, round_hf=stored)
            if diff > tolerance:
                raise ConvertError(f"--verify: max |logit diff| {diff:.3e} > tolerance {tolerance:g}; "
                                   f"conversion of {hf_dir} is wrong (a weight mapped wrongly, or a config.json "
                                   "field that transformers reads otherwise than our model), nothing written")
            report["rope_checked_at"] = check_rope_far_out(hf_dir, cfg, str(hf_dir))
    report.update(seconds=round(time.time() - start, 2), peak_rss_bytes=peak_rss_bytes())
    return report
