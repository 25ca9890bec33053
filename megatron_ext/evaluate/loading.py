"""Loading models to evaluate (HF directories, Megatron checkpoints via the converter) and memory notes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from megatron_ext.disk_space import SPACE_ERRNOS
from megatron_ext.evaluate.errors import EvalError
from megatron_ext.evaluate.generate import auto_prefill_chunk
from megatron_ext.evaluate.io import not_there

ROOT = Path(__file__).resolve().parents[2]
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _config_dict(config) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


def kv_cache_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token: 2 (K and V) x layers x KV heads x head_dim x bytes per element.

    `config` is an HF config (object or `config.json` dict). Llama-3.1-8B in bf16: 131072 (128 KiB).
    """
    from megatron_ext.cost_model import kv_cache_bytes_per_token as planned  # the planner's formula, one copy

    return int(planned(_config_dict(config), dtype_bytes))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def memory_note(config, length: int, batch: int = 1, dtype_bytes: int = 2, n_params: int | None = None,
                free_bytes: int | None = None) -> str:
    """One paragraph on the memory a `length`-token prompt needs: KV cache, weights, the transient of a chunked
    prefill, and what is free."""
    cfg = _config_dict(config)
    per_tok = kv_cache_bytes_per_token(cfg, dtype_bytes)
    kv = per_tok * length * batch
    heads = cfg["num_attention_heads"]
    kv_heads, head_dim = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads
    parts = (f"memory note: KV cache {human_bytes(per_tok)}/token (2 x {cfg['num_hidden_layers']} layers x "
             f"{kv_heads} KV heads x {head_dim} head_dim x {dtype_bytes} bytes); {length:,} tokens x batch {batch} = "
             f"{human_bytes(kv)}")
    if n_params is not None:
        parts += f" + weights {human_bytes(n_params * dtype_bytes)}"
    chunk, transient = auto_prefill_chunk(length, batch), 0
    if chunk < length:
        # A chunk after the first attends to the cache through a [batch, chunk, length] mask, and with a mask
        # transformers hands SDPA the KV heads repeated to the query heads (one layer's keys and values at a time).
        transient = batch * chunk * length + (2 * batch * heads * length * head_dim * dtype_bytes
                                              if kv_heads < heads else 0)
        parts += (f" + up to {human_bytes(transient)} while a layer runs a prefill chunk (its mask"
                  f"{f', keys and values repeated to {heads} heads' if kv_heads < heads else ''})")
    if free_bytes is not None:
        need = kv + (n_params or 0) * dtype_bytes + transient
        parts += f"; device has {human_bytes(free_bytes)} free"
        if need > free_bytes:
            parts += (" -- this will NOT fit: lower the largest length or the batch (--batch-tokens), use a "
                      "device with more memory, or run the Megatron checkpoint over several GPUs (--megatron CKPT "
                      "--engine megatron --cp N under torchrun: each prompt and its KV cache split N ways)")
    return parts


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU unless given ('bf16', 'fp16', 'fp32' or a torch dtype)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise EvalError(f"--dtype {dtype}: not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def check_device(spec: str | None, megatron_engine: bool = False) -> None:
    """DeviceError (one line from tools/niah.py) unless `spec` is None, cpu, cuda or cuda:N on a GPU this process
    sees: torch's own errors for these ("Torch not compiled with CUDA enabled", "Expected one of cpu, cuda, ...")
    come deep inside model loading, as tracebacks."""
    from megatron_ext.runtime import DeviceError

    if spec is None or spec == "cpu":
        return
    m = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if m is None:
        raise DeviceError(f"--device {spec}: not a device this tool runs on; give cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {spec}: no CUDA device is visible to this process (torch {torch.__version__}); "
                          "use --device cpu, or run on a machine with a GPU")
    if m.group(1) is not None:
        if megatron_engine:  # it puts each rank on the GPU of its local rank
            raise DeviceError(f"--device {spec}: the Megatron engine places each rank on its local GPU; give "
                              "--device cuda (choose GPUs with CUDA_VISIBLE_DEVICES)")
        if int(m.group(1)) >= torch.cuda.device_count():
            raise DeviceError(f"--device {spec}: this process sees {torch.cuda.device_count()} CUDA device(s), "
                              f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def load_tokenizer(location: str | Path, what: str, fix: str):
    """AutoTokenizer from a directory or hub name; EvalError naming `what` (the flag and value it came from) and
    `fix` (what the user can do) when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location)
    except Exception as e:  # noqa: BLE001 - transformers raises many types (AttributeError for a bad config value)
        reason = " ".join(str(e).split())  # transformers' messages span lines; tools/niah.py prints one
        if not isinstance(e, (OSError, ValueError)):
            reason = f"{type(e).__name__}: {reason}"
        if not Path(location).exists():  # a mistyped folder is looked up on the hub (retried for ~50 s offline)
            reason = f"no local folder {str(location)!r}, and as a hub name: {reason}"
        raise EvalError(f"{what}: cannot load its tokenizer ({reason}); {fix}") from None


# A tokenizer's files as transformers saves or reads them, in a model folder: the fast tokenizer, its settings,
# and the vocabularies of the slow ones (SentencePiece, tiktoken, BPE/WordPiece files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.tiktoken", "vocab.json",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def model_tokenizer(path: str | Path):
    """The tokenizer saved in the HF model folder `path`. EvalError naming the folder: when it holds no tokenizer
    files (an export without --tokenizer), where transformers falls back to converting a slow tokenizer and
    blames a missing sentencepiece or tiktoken; and when the files there do not load."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise EvalError(f"model directory {path} has no tokenizer files (tokenizer.json, tokenizer_config.json); "
                        "give --tokenizer DIR, or export again with tools/convert.py to-hf --tokenizer DIR")
    return load_tokenizer(path, f"model directory {path}", "save the tokenizer next to the model "
                          "(tokenizer.save_pretrained(DIR)) or give --tokenizer DIR_OR_NAME")


def megatron_tokenizer(checkpoint, given, recorded, vocab_size: int | None):
    """The tokenizer of a Megatron checkpoint: --tokenizer's (`given`) or the one the checkpoint records. EvalError
    naming the checkpoint and --tokenizer when none loads, or when --tokenizer's has ids the model lacks."""
    if given:
        tok = load_tokenizer(given, f"--tokenizer {given}", "give a tokenizer directory (tokenizer.json ...) or a "
                             "hub name")
        check_vocab(tok, vocab_size, f"--tokenizer {given}")
        return tok
    if not recorded:
        raise EvalError(f"--megatron {checkpoint}: the checkpoint records no tokenizer; give --tokenizer "
                        "DIR_OR_NAME (the tokenizer the model was trained with)")
    tok = load_tokenizer(recorded, f"--megatron {checkpoint}", f"it records the tokenizer {recorded}; give "
                         "--tokenizer DIR_OR_NAME (the tokenizer the model was trained with)")
    check_vocab(tok, vocab_size, f"the tokenizer {recorded} that --megatron {checkpoint} records")
    return tok


def load_hf(path: str | Path, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
            tokenizer=None):
    """(model, tokenizer) from a Hugging Face model directory, in eval mode on `device`.

    Device defaults to CUDA when available; dtype to bf16 on GPU and fp32 on CPU. Attention is
    torch SDPA (memory-efficient/flash kernels on GPU); RoPE angles are formed as in training
    (`hf_rope.rope_angles_as_trained`: float64 unless config.json says `rope_angle_precision: float32`).
    `tokenizer`: a loaded tokenizer to use instead of the directory's (tools/niah.py --tokenizer, or the one of
    a converted Megatron checkpoint).
    """
    from transformers import AutoModelForCausalLM

    from megatron_ext.evaluate.hf_rope import rope_angles_as_trained
    from megatron_ext.progress import quiet_library_bars

    path = Path(path)
    if not path.is_dir():
        raise EvalError(f"model directory {path} {not_there(path, 'folder')}: give a Hugging Face model directory "
                        "(config.json, *.safetensors, tokenizer files)")
    if not (path / "config.json").is_file():
        raise EvalError(f"model directory {path} has no config.json: it is not a Hugging Face checkpoint "
                        "(for a Megatron checkpoint use --megatron DIR)")
    from megatron_ext.hf_config import read_config_json

    try:
        config = read_config_json(path / "config.json")
    except ValueError as e:
        raise EvalError(f"{path / 'config.json'}: {e}") from None
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "modelopt":  # transformers skips it: FP8 codes read as plain numbers, the scales ignored
        raise EvalError(f"model directory {path} is a ModelOpt FP8 export (tools/quantize.py), which transformers "
                        "loads as wrong numbers without an error: evaluate the BF16 folder it came from (its "
                        "--check compares the two), and serve this one with vLLM or TensorRT-LLM")
    dev = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, dev)
    if tokenizer is None:
        tokenizer = model_tokenizer(path)
    import transformers
    from packaging.version import Version

    # `dtype=` since transformers 4.56; `torch_dtype=` before (older versions ignore unknown names).
    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    from safetensors import SafetensorError

    quiet_library_bars()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **{dtype_key: torch_dtype})
    except (OSError, ValueError, SafetensorError) as e:  # weights missing, cut short, or of another shape
        raise EvalError(f"model directory {path}: cannot load the model's weights ({type(e).__name__}: "
                        f"{' '.join(str(e).split())}); give a complete Hugging Face model folder") from None
    try:  # as in training: float32 and float64 angles near 4M tokens differ by up to 0.125 rad
        rope_angles_as_trained(model)
    except ValueError as e:
        raise EvalError(f"model directory {path}: {e}; fix config.json (or remove the key: float64)") from None
    return model.to(dev).eval(), tokenizer


def check_vocab(tokenizer, vocab_size: int | None, what: str) -> None:
    """EvalError when `tokenizer` makes ids the model has no embedding for (an IndexError deep in the forward
    pass otherwise): a tokenizer given by hand, or saved with the model (model.tokenizer of the run), that is not
    the model's."""
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise EvalError(f"{what} has {len(tokenizer):,} tokens but the model's vocab_size is {vocab_size:,}: it is "
                        "not this model's tokenizer; give the one the model was trained with (--tokenizer)")


def convert_megatron(megatron_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a Megatron checkpoint to an HF directory with the project's converter (`tools/convert.py to-hf`).

    EvalError when the converter is not part of this installation.
    """
    megatron_dir, out_dir = Path(megatron_dir), Path(out_dir)
    script = check_convertible(megatron_dir)
    cmd = [sys.executable, str(script), "to-hf", "--megatron", str(megatron_dir), "--out", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        line = tail[0].removeprefix("error: ")
        # Converting by hand helps only where the copy into --out failed; a bad checkpoint fails there the same way.
        hint = ("; the conversion copies the weights into a hidden folder of --out first: free space there, or "
                f"convert it onto a file system with room (`python tools/convert.py to-hf --megatron {megatron_dir} "
                "--out HF_DIR`) and pass --model HF_DIR" if _about_the_output(line, out_dir) else "")
        raise EvalError(f"converting {megatron_dir} to HF failed: {line}{hint}")
    return out_dir


# What writing the copy can meet and reading the checkpoint cannot: a full disk, a quota, a file size limit.
_OUTPUT_ERRORS = tuple(os.strerror(n) for n in SPACE_ERRNOS)


def _about_the_output(line: str, out_dir: Path) -> bool:
    """Whether the converter's error `line` concerns its output (the temporary folder `out_dir` is in --out)."""
    return str(out_dir.parent) in line or any(text in line for text in _OUTPUT_ERRORS)


def _convert_hint(megatron_dir: Path) -> str:
    return (f"convert it first with `python tools/convert.py to-hf --megatron {megatron_dir} --out HF_DIR` "
            "and pass --model HF_DIR")


def check_convertible(megatron_dir: str | Path) -> Path:
    """EvalError unless `megatron_dir` is a Megatron checkpoint (a root with a latest iteration, or an iter_*
    folder; not a file, not an HF model folder) whose metadata reads and whose files are all there at the sizes
    its index gives, and the converter is installed; the path of tools/convert.py. Checked before the conversion
    starts (and before tools/niah.py says it does)."""
    megatron_dir = Path(megatron_dir)
    if megatron_dir.exists() and not megatron_dir.is_dir():
        raise EvalError(f"--megatron {megatron_dir} is a file, not a Megatron checkpoint folder")
    if not megatron_dir.is_dir():
        raise EvalError(f"Megatron checkpoint directory {megatron_dir} does not exist")
    if (megatron_dir / "config.json").is_file() and not any(megatron_dir.glob("iter_*")):
        raise EvalError(f"--megatron {megatron_dir} is a Hugging Face model folder (config.json), not a Megatron "
                        f"checkpoint: pass --model {megatron_dir}")
    from megatron_ext.checkpoint_index import CheckpointError, check_complete
    from megatron_ext.checkpoint_layout import checked_metadata, resolve_iteration_dir

    try:  # the converter's own checks, without its imports (~10 s): no "converting ..." for a broken checkpoint
        _, path = resolve_iteration_dir(megatron_dir)
        checked_metadata(path)
        check_complete(path)
    except CheckpointError as e:
        raise EvalError(f"--megatron {megatron_dir}: {e}") from None
    except OSError as e:  # a permission, a file system gone: the converter's reads would meet it too
        where = f": {e.filename}" if e.filename else ""
        raise EvalError(f"--megatron {megatron_dir}: cannot read the checkpoint ({e.strerror or e}{where}); check "
                        "its files' permissions, or copy it again") from None
    script = ROOT / "tools" / "convert.py"
    if importlib.util.find_spec("megatron_ext.convert") is None or not script.is_file():
        raise EvalError("--megatron needs the converter (megatron_ext.convert), which this installation lacks: "
                        + _convert_hint(megatron_dir))
    return script
