"""FP8 post-training quantization and HF export with NVIDIA ModelOpt (`nvidia-modelopt`).

ModelOpt inserts quantizers around every linear layer's weight and input ("fake" quantization:
round to FP8 E4M3 with a per-tensor scale, compute in the original dtype, so it runs on CPU) and,
for the KV cache, on the key/value inputs of the attention matmuls. `calibrate` runs our long
samples through the model so each quantizer records its absolute maximum (amax); the FP8 scale is
amax / 448. `export_hf_checkpoint` then stores E4M3 weights with their `weight_scale`/`input_scale`
and the `k_scale`/`v_scale` of the KV cache, and a `quantization_config` (quant_method "modelopt")
in config.json that vLLM and TensorRT-LLM read.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from megatron_ext.progress import progress_bar, quiet_library_bars
from megatron_ext.quantize.errors import QuantizeError

# Architectures this stack trains and exports (tools/convert.py to-hf writes LlamaForCausalLM).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
KV_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer")


def modelopt():
    """(modelopt version, `modelopt.torch.quantization`, `modelopt.torch.export`), or a QuantizeError."""
    try:
        import modelopt as mo
        import modelopt.torch.export as mte
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise QuantizeError(f"NVIDIA ModelOpt is not importable ({e}): pip install 'megatron-ext[quantize]' "
                            "(nvidia-modelopt)") from None
    return mo.__version__, mtq, mte


def read_hf_config(hf_dir: str | Path) -> dict:
    """config.json of `hf_dir`, checked: it names one supported architecture."""
    path = Path(hf_dir) / "config.json"
    from megatron_ext.hf_config import pruned_link_problem, read_config_json

    if not path.is_file():
        raise QuantizeError(pruned_link_problem(Path(hf_dir), "config.json")
                            or f"--hf {hf_dir}: no config.json there; pass a Hugging Face model directory "
                            "(tools/convert.py to-hf writes one)")

    try:
        cfg = read_config_json(path)
    except ValueError as e:
        raise QuantizeError(f"{path}: {e}") from None
    arch = cfg.get("architectures")
    if not arch:
        raise QuantizeError(f"{path} has no \"architectures\" field, which ModelOpt's export needs to name the "
                            f"model class: add \"architectures\": [\"LlamaForCausalLM\"] to it")
    bad = [a for a in arch if a not in SUPPORTED_ARCHITECTURES]
    if bad or len(arch) != 1:
        raise QuantizeError(f"{path}: architectures {arch} is not supported; tools/quantize.py exports "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} (the models this stack trains)")
    if cfg.get("quantization_config"):
        raise QuantizeError(f"{path} already has a quantization_config "
                            f"({cfg['quantization_config'].get('quant_method', '?')}): quantize the original model")
    return cfg


def quant_config(mtq, weights: str = "fp8", kv_cache: str = "fp8", version: str = "?") -> dict:
    """The ModelOpt config for FP8 weights+activations and/or FP8 KV cache.

    Handles both forms of `quant_cfg`: a list of entries (ModelOpt >= 0.4x) and a wildcard dict (older).
    """
    if weights not in ("fp8", "none") or kv_cache not in ("fp8", "none"):
        raise QuantizeError(f"--weights/--kv-cache take fp8 or none, got {weights!r}/{kv_cache!r}")
    if weights == "none" and kv_cache == "none":
        raise QuantizeError("--weights none with --kv-cache none quantizes nothing: choose fp8 for at least one")
    if kv_cache == "fp8" and not hasattr(mtq, "FP8_KV_CFG"):
        raise QuantizeError(f"ModelOpt {version} has no FP8 KV-cache config (FP8_KV_CFG): upgrade with "
                            "pip install -U 'nvidia-modelopt>=0.47', or pass --kv-cache none")
    if weights == "fp8":
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    else:  # KV cache only: every other quantizer off
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
        if hasattr(mtq.FP8_DEFAULT_CFG.get("quant_cfg"), "items"):
            cfg["quant_cfg"] = {"default": {"enable": False}}
    if kv_cache == "fp8":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        base = cfg["quant_cfg"]
        cfg["quant_cfg"] = {**base, **kv} if isinstance(base, dict) else list(base) + list(kv)
    cfg.setdefault("algorithm", "max")
    return cfg


def load_model(hf_dir: str | Path, dtype: str = "auto", device: str | None = None):
    """The HF model in eval mode (`dtype` "auto": as stored) on `device` (default: cuda if available)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        quiet_library_bars()
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype)
    except (OSError, ValueError, SafetensorError) as e:  # weights missing, cut short, or of another shape
        raise QuantizeError(f"--hf {hf_dir}: cannot load the model's weights ({type(e).__name__}: "
                            f"{' '.join(str(e).split())}); give a complete Hugging Face model folder") from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def load_tokenizer(path: str | Path, required: bool = False):
    """The tokenizer saved in `path`, or None when there is none (indexed data needs no tokenizer)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types (AttributeError for a bad config value)
        if required:
            raise QuantizeError(f"--tokenizer {path}: cannot load a tokenizer ({type(e).__name__}: "
                                f"{' '.join(str(e).split())})") from None
        return None


@torch.no_grad()
def calibrate_forward(windows: Sequence[torch.Tensor], progress: bool = True):
    """A ModelOpt `forward_loop`: each window [L] through the model as a batch of one."""
    def loop(model) -> None:
        device = next(model.parameters()).device
        for w in progress_bar(windows, desc="calibrate", unit="sample", enabled=progress):
            # logits_to_keep=1: the unquantized lm_head needs no statistics, and full logits at 1M
            # positions would take L x vocab x 4 bytes (0.5 TB at 1M tokens)
            model(input_ids=w[None].to(device), use_cache=False, logits_to_keep=1)
    return loop


def quantize(model, windows: Sequence[torch.Tensor], weights: str = "fp8", kv_cache: str = "fp8",
             progress: bool = True):
    """Quantize `model` in place with ModelOpt, calibrated on `windows`; returns the model.

    Checks that calibration reached every enabled quantizer (a quantizer without amax would export
    no scale), in particular the KV-cache ones, which depend on ModelOpt hooking the attention.
    """
    version, mtq, _ = modelopt()
    cfg = quant_config(mtq, weights, kv_cache, version)
    model = mtq.quantize(model, cfg, calibrate_forward(windows, progress))
    missing = [n for n, q in tensor_quantizers(model) if q.is_enabled and getattr(q, "amax", None) is None
               and not getattr(q, "_dynamic", False)]
    kv_missing = [n for n in missing if n.endswith(KV_QUANTIZERS)]
    if kv_missing:
        raise QuantizeError(f"calibration left {len(missing)} quantizers without a scale (e.g. {kv_missing[0]}): "
                            f"ModelOpt {version} did not hook this model's attention "
                            f"({model.config._attn_implementation}); try --kv-cache none or another ModelOpt")
    if missing:  # a layer the forward never calls gets a weight scale from its weights, no input scale
        raise QuantizeError(f"calibration left {len(missing)} quantizers without a scale (e.g. {missing[0]}): the "
                            "calibration forward never reached their layers, which the model's forward does not "
                            "call; quantize a model without such layers")
    if kv_cache == "fp8" and not any(n.endswith(KV_QUANTIZERS) and q.is_enabled for n, q in tensor_quantizers(model)):
        raise QuantizeError(f"ModelOpt {version} inserted no KV-cache quantizers into {type(model).__name__}: "
                            "pass --kv-cache none or upgrade nvidia-modelopt")
    return model


def tensor_quantizers(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, TensorQuantizer) of every ModelOpt quantizer in `model`."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, mod in model.named_modules():
        if isinstance(mod, TensorQuantizer):
            yield name, mod


@contextmanager
def quantizers_disabled(model):
    """Run the quantized model as the original: every enabled quantizer is bypassed, then restored.

    Fake quantization leaves the weights untouched, so this is exactly the unquantized model
    without a second copy in memory (8B: 16 GB saved).
    """
    off = [q for _, q in tensor_quantizers(model) if q.is_enabled]
    for q in off:
        q.disable()
    try:
        yield model
    finally:
        for q in off:
            q.enable()


def quantized_layers(model) -> dict[str, list[str]]:
    """Module names by treatment: `fp8_linear` (weights+inputs FP8), `fp8_kv_cache` (attention
    modules whose K and V are FP8), `kept` (linear/embedding layers left in the original dtype)."""
    enabled = {n for n, q in tensor_quantizers(model) if q.is_enabled}
    out: dict[str, list[str]] = {"fp8_linear": [], "fp8_kv_cache": [], "kept": []}
    for name, mod in model.named_modules():
        if f"{name}.weight_quantizer" in enabled:
            out["fp8_linear"].append(name)
        elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            out["kept"].append(name)
        if all(f"{name}.{k}" in enabled for k in KV_QUANTIZERS):
            out["fp8_kv_cache"].append(name)
    return out


def export(model, out_dir: str | Path, tokenizer=None, extra_files: dict[str, str] | None = None) -> Path:
    """Write the ModelOpt HF checkpoint (and tokenizer) to `out_dir` atomically.

    It is written into a temporary sibling directory and renamed into place when complete, so a
    failure leaves no half-written checkpoint. `out_dir` must not exist yet. ModelOpt packs the
    weights to FP8 in place, so the model cannot run afterwards: check it before exporting.
    """
    _, _, mte = modelopt()
    out = Path(out_dir)
    if out.exists():
        raise QuantizeError(f"--out {out} exists: remove it or choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        mte.export_hf_checkpoint(model, export_dir=str(tmp))
        _rope_in_transformers4_form(tmp / "config.json")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; a folder made the usual way honours the umask
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _rope_in_transformers4_form(path: Path) -> None:
    """Rewrite ModelOpt's `config.json` (saved by transformers 5: `rope_parameters`, `dtype`) in the form the
    converter writes (`rope_theta` + `rope_scaling`, `torch_dtype`), which transformers 4 and 5 and vLLM read.

    A server on transformers 4 does not read `rope_parameters`: it would run the model with theta 10000 and
    no YaRN, silently wrong past the original context.
    """
    from megatron_ext.hf_config import normalize_hf_config

    cfg = json.loads(path.read_text())
    out = normalize_hf_config(cfg)
    out.pop("rope_parameters", None)
    if out.get("torch_dtype") is None and out.get("dtype") is not None:
        out["torch_dtype"] = out["dtype"]
    path.write_text(json.dumps(out, indent=2) + "\n")


def checkpoint_bytes(directory: str | Path) -> int:
    """Bytes of the weight files (*.safetensors, *.bin, *.pt) in `directory`."""
    return sum(p.stat().st_size for p in Path(directory).iterdir()
               if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file())
