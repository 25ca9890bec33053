"""Hugging Face side of the converter: checked config, streamed safetensors in, sharded safetensors out."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from megatron_ext.hf_config import normalize_hf_config, pruned_link_problem, read_config_json
from megatron_ext.presets import ROPE_PRESETS


class ConvertError(Exception):
    """Bad converter input or a failed check (one clear message; the CLI prints it and exits 1)."""


SUPPORTED_ROPE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
# The files that hold a tokenizer's vocabulary: without one, the others are settings no tokenizer loads from
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model")
GENERATION_CONFIG = "generation_config.json"
# Size fields every Llama config.json must state (the tensor shapes follow from them).
REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_hf_config(hf_dir: Path) -> dict:
    """`config.json` of a Llama checkpoint, normalised to the transformers-4 form, after support checks."""
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf {hf_dir}: " + ("is a file, not a folder" if hf_dir.exists() else "directory does not exist")
                           + "; give a Hugging Face model folder")
    path = hf_dir / "config.json"
    if not path.is_file():
        pruned = pruned_link_problem(hf_dir, "config.json")
        if pruned:
            raise ConvertError(pruned)
        if is_megatron_checkpoint(hf_dir):
            raise ConvertError(f"--hf {hf_dir} is a Megatron checkpoint (iter_* folders), not a Hugging Face model "
                               f"folder; to export it: python tools/convert.py to-hf --megatron {hf_dir} --out HF_DIR")
        raise ConvertError(f"--hf {hf_dir}: no config.json; point --hf at a Hugging Face model folder")
    try:
        raw = read_config_json(path)
    except ValueError as e:
        raise ConvertError(f"{path}: {e}") from None
    check_llama(raw, str(path))
    return normalize_hf_config(raw)


def is_megatron_checkpoint(folder: Path) -> bool:
    """A Megatron checkpoint root (the latest pointer or iter_* folders) or one iteration folder (our metadata)."""
    from megatron_ext.checkpoint_index import METADATA_FILE
    from megatron_ext.checkpoint_layout import LATEST_FILE, available_iterations

    return (folder / LATEST_FILE).is_file() or (folder / METADATA_FILE).is_file() or bool(available_iterations(folder))


def is_hf_model_folder(folder: Path) -> bool:
    """A config.json and no Megatron checkpoint beside it."""
    return (folder / "config.json").is_file() and not is_megatron_checkpoint(folder)


def check_llama(raw: dict, where: str) -> None:
    """Raise ConvertError unless `raw` is a Llama (3.x family) causal LM config we convert exactly."""
    arch = raw.get("architectures") or ["LlamaForCausalLM"]
    if raw.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise ConvertError(f"{where}: model_type={raw.get('model_type')!r}, architectures={arch}; "
                           "only LlamaForCausalLM (model_type 'llama') is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConvertError(f"{where}: {flag}=true is not supported (Llama-3.1 has no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"{where}: hidden_act={raw.get('hidden_act')!r}; only 'silu' (SwiGLU) is supported")
    for key in REQUIRED_INTS:
        value = raw.get(key)
        if value is None:
            raise ConvertError(f"{where}: {key} is missing; a Llama config.json needs {', '.join(REQUIRED_INTS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConvertError(f"{where}: {key} = {value!r}: must be a positive integer")
    _check_optional_fields(raw, where)
    cfg = normalize_hf_config(raw)
    rope = (cfg.get("rope_scaling") or {}).get("rope_type", "default")
    if rope not in SUPPORTED_ROPE:
        raise ConvertError(f"{where}: rope_scaling.rope_type={rope!r} is not supported; "
                           f"expected one of {', '.join(SUPPORTED_ROPE)}")
    check_rope(raw, where)
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ConvertError(f"{where}: num_attention_heads={cfg['num_attention_heads']} is not a multiple of "
                           f"num_key_value_heads={cfg['num_key_value_heads']}")


def _check_optional_fields(raw: dict, where: str) -> None:
    """Raise ConvertError for a field transformers and our model would read differently, or a value neither can
    use (a null, a string for a number): these converted, and only --verify, if given, noticed (as a logit
    difference naming no field), or crashed with a traceback."""
    for key in ("num_key_value_heads", "head_dim"):  # null: derived, as transformers does
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConvertError(f"{where}: {key} = {value!r}: must be a positive integer (or absent)")
    for key in ("rms_norm_eps", "rope_theta"):
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], (int, float)) or raw[key] <= 0):
            raise ConvertError(f"{where}: {key} = {raw[key]!r}: must be a positive number")
    if "tie_word_embeddings" in raw and not isinstance(raw["tie_word_embeddings"], bool):
        raise ConvertError(f"{where}: tie_word_embeddings = {raw['tie_word_embeddings']!r}: must be true or false")
    for block in (raw, raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}):
        factor = block.get("partial_rotary_factor", 1.0) if isinstance(block, dict) else 1.0
        if factor != 1.0:
            raise ConvertError(f"{where}: partial_rotary_factor = {factor!r}: transformers' Llama rotates every "
                               "dimension (it ignores the field for the default rope and fails on scaled ones), so "
                               "no Llama checkpoint matches a model that rotates part of each head; only 1.0")


def check_rope(raw: dict, where: str) -> None:
    """Raise ConvertError unless the rope block passes the project's validator (`rope_spec`).

    The same check recipes get: a block transformers would crash on (llama3 without low_freq_factor,
    yarn without factor) or read differently from us (rope_scaling and rope_parameters that disagree;
    normalize_hf_config would silently keep rope_parameters) must not become a checkpoint or an export.
    """
    from megatron_ext.rope_spec import RopeConfigError, rope_spec

    try:
        rope_spec(raw)
    except RopeConfigError as e:
        raise ConvertError(f"{where}: {e}") from None


def source_dtype(cfg: dict) -> torch.dtype:
    """Dtype the HF config declares (`torch_dtype` or `dtype`), bf16 if absent."""
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _read_header(path: Path) -> dict[str, dict]:
    """Tensor entries (dtype, shape, data_offsets) of a safetensors file, checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise ConvertError(f"{path}: not a safetensors file (bad header length); re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConvertError(f"{path}: corrupt safetensors header; re-download it") from None
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, e in header.items():
        start, end = e["data_offsets"]
        if e["dtype"] not in _ST_DTYPES:
            raise ConvertError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        if end > data_size or start > end:
            raise ConvertError(f"{path}: tensor {name} extends past the end of the file "
                               f"({end} > {data_size} bytes); the file is truncated, re-download it")
        e["base"] = 8 + n
    return header


class SafetensorsReader:
    """Name -> file index of an HF checkpoint; tensors are read one at a time with plain reads.

    Plain reads (not memory maps) keep resident memory at the tensors the converter holds.
    """

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConvertError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
            if not files:
                extra = " (only PyTorch .bin weights found; re-save with safe_serialization=True)" \
                    if list(hf_dir.glob("*.bin")) else ""
                raise ConvertError(f"--hf {hf_dir}: no *.safetensors weights{extra}")
            weight_map = None
        self.file_of: dict[str, str] = {}
        self._entries: dict[str, dict] = {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                pruned = pruned_link_problem(hf_dir, name)
                if pruned:
                    raise ConvertError(pruned)
                if weight_map is None:  # a folder named *.safetensors
                    raise ConvertError(f"--hf {hf_dir}: {name} is not a file; move it out of the model folder")
                raise ConvertError(f"{index}: names shard {name}, which does not exist in {hf_dir}")
            for key, entry in _read_header(path).items():
                if weight_map is not None and weight_map.get(key, name) != name:
                    continue  # a copy in another shard: the index names the model's
                if key in self.file_of:  # two copies (a stray file from another save): which is the model's?
                    raise ConvertError(f"--hf {hf_dir}: tensor {key} is in both {self.file_of[key]} and {name}; "
                                       "remove the file that is not part of this model")
                self.file_of[key], self._entries[key] = name, entry
        if weight_map is not None:
            missing = [k for k, f in weight_map.items() if self.file_of.get(k) != f]
            if missing:
                raise ConvertError(f"{index}: {len(missing)} tensors listed but not in their shard, "
                                   f"e.g. {missing[0]} in {weight_map[missing[0]]}; the download is incomplete")

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        start, end = e["data_offsets"]
        buf = bytearray(end - start)
        with open(self.dir / self.file_of[name], "rb") as f:
            f.seek(e["base"] + start)
            if f.readinto(buf) != len(buf):
                raise ConvertError(f"{self.dir / self.file_of[name]}: short read of tensor {name}; re-download it")
        if not buf:
            return torch.empty(e["shape"], dtype=_ST_DTYPES[e["dtype"]])
        return torch.frombuffer(buf, dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"])


class StreamingSafetensorsWriter:
    """Writes `model-0000i-of-0000n.safetensors` shards tensor by tensor, holding none of them.

    The plan (names, shapes, dtypes in write order) is known before any data is read, so every shard's
    header (with all byte offsets) is written first and each tensor's bytes are appended as it arrives.
    """

    def __init__(self, out_dir: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = 5 * 2**30):
        self.out = out_dir
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = []
        size = 0
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        n = len(shards)
        self.shards = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", items) for i, items in enumerate(shards)]
        self.queue = [(si, item) for si, (_, items) in enumerate(self.shards) for item in items]
        self.pos = 0
        self.total = sum(item[3] for _, item in self.queue)
        self._fh = None

    def _open(self, shard: int) -> None:
        name, items = self.shards[shard]
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tname, shape, dtype, nbytes in items:
            header[tname] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._fh = open(self.out / name, "wb")
        self._fh.write(len(raw).to_bytes(8, "little") + raw)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Append the next tensor of the plan (same name, shape and dtype, in plan order)."""
        if self.pos >= len(self.queue):
            raise ValueError(f"tensor {name} is not in the write plan")
        shard, (want, shape, dtype, _) = self.queue[self.pos]
        if name != want or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"expected {want} {list(shape)} {dtype}, got {name} {list(t.shape)} {t.dtype}")
        if self._fh is None:
            self._open(shard)
        self._fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        self.pos += 1
        if self.pos == len(self.queue) or self.queue[self.pos][0] != shard:
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        """Check every planned tensor arrived and write `model.safetensors.index.json`."""
        if self.pos != len(self.queue):
            missing = [item[0] for _, item in self.queue[self.pos:]]
            raise ValueError(f"{len(missing)} planned tensors were not written, e.g. {missing[0]}")
        weight_map = {item[0]: name for name, items in self.shards for item in items}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def export_config(cfg: dict, dtype: torch.dtype, rope_preset: str | None, max_positions: int | None) -> dict:
    """HF `config.json` (transformers-4 form: `rope_theta` + `rope_scaling`) for the exported model."""
    out = normalize_hf_config(cfg)
    if rope_preset is not None:
        if rope_preset not in ROPE_PRESETS:
            raise ConvertError(f"--rope-preset {rope_preset!r}: expected one of {', '.join(ROPE_PRESETS)}")
        # the shared UltraLong blocks (transformers-5 form) -> transformers-4 `rope_theta` + `rope_scaling`
        block = normalize_hf_config({**out, "rope_parameters": ROPE_PRESETS[rope_preset]})
        out["rope_theta"], out["rope_scaling"] = block["rope_theta"], block["rope_scaling"]
        scaling = out["rope_scaling"]
        out["max_position_embeddings"] = int(scaling["factor"] * scaling["original_max_position_embeddings"])
    if max_positions is not None:
        _set_max_positions(out, max_positions)
    for key in ("rope_parameters", "dtype", "transformers_version"):
        out.pop(key, None)
    out["architectures"], out["model_type"] = ["LlamaForCausalLM"], "llama"
    out["torch_dtype"] = dtype_name(dtype)
    if rope_preset is not None or max_positions is not None:  # the flags changed the rope block or its lengths
        flag = f"--rope-preset {rope_preset}" if rope_preset else f"--max-position-embeddings {max_positions}"
        check_rope(out, f"{flag}: the exported config.json would be invalid")
    return out


# Rope types whose frequencies transformers derives from max_position_embeddings itself: dynamic
# rescales past it at run time, longrope picks its factor and attention scale from max / original.
_ROPE_READS_MAX_POSITIONS = ("dynamic", "longrope")


def _set_max_positions(out: dict, max_positions: int) -> None:
    """Declare another context length in `out` (normalised) without changing what the model computes."""
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ConvertError(f"--max-position-embeddings {max_positions}: must be a positive integer "
                           "(the context length the model was trained for, e.g. 1048576)")
    old = out.get("max_position_embeddings")
    if max_positions == old:
        return
    scaling = out.get("rope_scaling") or {}
    rope = scaling.get("rope_type", "default")
    if rope in _ROPE_READS_MAX_POSITIONS:
        raise ConvertError(f"--max-position-embeddings {max_positions}: the checkpoint's rope_type {rope!r} computes "
                           f"its frequencies from max_position_embeddings ({old}), so another value would change "
                           "the model; export without the flag (or train with the rope you want to declare)")
    if "original_max_position_embeddings" in _rope_fields(rope) and "original_max_position_embeddings" not in scaling \
            and out.get("original_max_position_embeddings") is None:
        # transformers falls back to max_position_embeddings for the pre-scaling length: pin the old value
        out["rope_scaling"] = {**scaling, "original_max_position_embeddings": old}
    out["max_position_embeddings"] = max_positions


def _rope_fields(rope_type: str) -> set[str]:
    from megatron_ext.rope_spec import ROPE_FIELDS

    return ROPE_FIELDS.get(rope_type, set())


def generation_config(cfg: dict, source: dict | None) -> dict:
    """The source model's generation config if known, else one naming its bos/eos tokens."""
    if source:
        return source
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}


def folder_generation_defaults(folder: Path) -> tuple[dict | None, dict]:
    """An HF model folder's generation config (None if it has none) and the bos/eos/pad ids of its config.json."""
    from megatron_ext.checkpoint_layout import TOKEN_ID_KEYS

    def read(name: str) -> dict:
        try:
            value = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    ids = {k: v for k, v in read("config.json").items() if k in TOKEN_ID_KEYS and v is not None}
    if not ids:  # a tokenizer folder alone (no model's config.json): the ids of the tokens it names
        ids = _tokenizer_special_ids(read("tokenizer_config.json"), read("tokenizer.json"))
    return read(GENERATION_CONFIG) or None, ids


def _tokenizer_special_ids(tokenizer_config: dict, tokenizer_json: dict) -> dict:
    """{"bos_token_id": id, ...} for the bos/eos/pad tokens a tokenizer_config.json names, found among
    tokenizer.json's added tokens (special tokens are added tokens); those not found are left out."""
    added = {t.get("content"): t.get("id") for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict)}
    ids = {}
    for key in ("bos", "eos", "pad"):
        token = tokenizer_config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(added.get(token), int):
            ids[f"{key}_token_id"] = added[token]
    return ids


def tokenizer_files(directory: Path | None) -> list[Path]:
    if directory is None or not directory.is_dir():
        return []
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]


def copy_tokenizer(directory: Path | None, out: Path) -> list[str]:
    """Copy the tokenizer files of `directory` into `out`; names of the files copied."""
    copied = []
    for f in tokenizer_files(directory):
        shutil.copy2(f, out / f.name)
        copied.append(f.name)
    return copied
