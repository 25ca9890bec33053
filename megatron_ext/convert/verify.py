"""Logit check: transformers' LlamaForCausalLM and our Megatron model on the same random tokens (fp32).

Both models run in float32. The converted side holds the weights as stored (bf16, fp16 or fp32); the
source side is rounded to those stored dtypes first. Rounding is the one intended change a conversion
makes, so the oracle must include it: otherwise a bf16 copy of an fp32 model differs by ~1e-3 in the
logits and fails a tolerance that is tight enough to catch a wrong mapping (a swapped head, a
transposed tensor). With rounding on the source side a correct conversion matches to float32 noise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megatron_ext.convert import mapping
from megatron_ext.convert.hf_io import ConvertError
from megatron_ext.progress import quiet_library_bars


@torch.no_grad()
def round_params_(model: torch.nn.Module, dtype_of: dict[str, torch.dtype] | torch.dtype) -> None:
    """Round a float32 model's parameters in place to the values a copy stored in a narrower dtype holds.

    `dtype_of` is one dtype for every parameter, or a dtype per parameter name (names not listed stay).
    """
    for name, p in model.named_parameters():
        dtype = dtype_of if isinstance(dtype_of, torch.dtype) else dtype_of.get(name)
        if dtype is not None and dtype != p.dtype:
            p.copy_(p.to(dtype).to(p.dtype))


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor,
              round_to: dict[str, torch.dtype] | torch.dtype | None = None) -> torch.Tensor:
    """transformers' logits `[b, s, vocab]` of the HF folder in float32 (eager attention).

    With `round_to`, the weights are first rounded as `round_params_` does (HF parameter names).
    """
    from transformers import LlamaForCausalLM

    quiet_library_bars()
    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if round_to is not None:
        round_params_(model, round_to)
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(root: str | Path, tokens: torch.Tensor, iteration: int | None = None,
                    hf_config: dict | None = None, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Our Megatron model's logits `[b, s, vocab]` (padding rows dropped) loaded from a checkpoint root, fp32.

    The architecture (and RoPE) comes from the checkpoint metadata unless `hf_config` is given.
    With `round_to`, every weight is first rounded to that dtype (what an export in that dtype stores).
    Needs a TP=1, PP=1 parallel state.
    """
    from megatron_ext.checkpoint import load_checkpoint
    from megatron_ext.checkpoint_layout import read_metadata, resolve_iteration_dir
    from megatron_ext.hf_config import normalize_hf_config
    from megatron_ext.model import BuildOptions, build_model

    _, path = resolve_iteration_dir(root, iteration)
    meta = read_metadata(path)
    cfg = normalize_hf_config(hf_config or meta["hf_config"])
    divisible = (meta.get("vocab") or {}).get("make_vocab_size_divisible_by", 128)
    opts = BuildOptions(device="cpu", precision="fp32", make_vocab_size_divisible_by=divisible,
                        seq_length=tokens.shape[1])
    try:
        model = build_model(cfg, opts)
    except NotImplementedError as e:
        raise ConvertError(f"--verify: our model cannot run this config yet ({e})") from None
    load_checkpoint(root, [model], iteration=iteration, weights_only=True)
    model.eval()
    if round_to is not None:
        round_params_(model, round_to)
    b, s = tokens.shape
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), None)
    return logits[..., : cfg["vocab_size"]].float()


def stored_hf_dtypes(iteration_dir: str | Path, cfg: dict) -> dict[str, torch.dtype]:
    """HF parameter name -> dtype its values are stored in by a Megatron checkpoint (one iteration folder).

    Read from the checkpoint itself, not assumed: a bf16 model may keep some tensors in float32.
    """
    from megatron_ext.convert.dist_reader import TorchDistReader

    reader = TorchDistReader(iteration_dir)
    out: dict[str, torch.dtype] = {}
    for e in mapping.entries(cfg["tie_word_embeddings"]):
        for layer in range(cfg["num_hidden_layers"]) if e.per_layer else [None]:
            for name in e.hf_names(layer):
                out[name] = reader.dtype(e.megatron)
    if cfg["tie_word_embeddings"]:  # transformers shares the embedding as lm_head; it is rounded once
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def random_tokens(vocab_size: int, batch: int = 2, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def compare_logits(hf_dir: str | Path, megatron_root: str | Path, iteration: int | None = None, *,
                   round_hf: dict[str, torch.dtype] | None = None, round_megatron: torch.dtype | None = None,
                   batch: int = 2, seq_len: int = 32, seed: int = 0, megatron_hf_config: dict | None = None) -> float:
    """Max |logit difference| of the HF folder vs the Megatron checkpoint on random tokens (fp32).

    The source side of a conversion is rounded to what the converted side stores: `round_hf`
    (per HF parameter) after an import, `round_megatron` (the exported dtype) after an export.
    `megatron_hf_config`: build the Megatron model with this config (an export's rope) instead of the checkpoint's.
    """
    import json

    from megatron_ext.convert.staging import ensure_cpu_process_group

    # Loading both models takes minutes at 8B and prints no bar: say what runs (stderr, beside the progress bars;
    # the result line below and the JSON report go to stdout)
    print(f"verify: comparing the logits of the Hugging Face model and the Megatron checkpoint on {batch}x{seq_len} "
          "random tokens (loads both models in fp32)", file=sys.stderr, flush=True)
    ensure_cpu_process_group()
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(vocab, batch, seq_len, seed)
    ref = hf_logits(hf_dir, tokens, round_hf)
    ours = megatron_logits(megatron_root, tokens, iteration, hf_config=megatron_hf_config, round_to=round_megatron)
    # NaN compares as no difference at all (nan > tolerance is False): a diverged model would pass
    bad = [what for what, t in (("the Hugging Face model's", ref), ("the Megatron checkpoint's", ours))
           if not torch.isfinite(t).all()]
    if bad:
        raise ConvertError(f"--verify: {' and '.join(bad)} logits are not finite (NaN or Inf): weights with NaN or "
                           "Inf values (a diverged run?) or beyond the range of the stored dtype; nothing written")
    diff = (ref - ours).abs().max().item()
    print(f"verify: max |logit diff| HF vs Megatron = {diff:.3e} (fp32 compute, source rounded to the stored "
          f"dtype, {batch}x{seq_len} random tokens)")
    return diff


def check_rope_far_out(hf_dir: str | Path, checkpoint_hf_config: dict, what: str) -> int:
    """The rotary table transformers derives from the HF folder's config equals the checkpoint's own (the rope the
    Megatron model is built with, megatron_ext.rope) at twice the longer of max_position_embeddings and the rope's
    original length; returns that length. The logit check sees 32 positions, where a dynamic rope is still plain
    RoPE: a rope block lost or changed on the way shows only further out. ConvertError naming both ropes otherwise."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_ext.hf_config import normalize_hf_config
    from megatron_ext.rope import rope_frequencies

    ours_cfg = normalize_hf_config(checkpoint_hf_config)
    original = (ours_cfg.get("rope_scaling") or {}).get("original_max_position_embeddings") or 0
    length = 2 * max(int(ours_cfg.get("max_position_embeddings") or 0), int(original), 32)
    config = LlamaConfig.from_pretrained(str(hf_dir))
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" and kind not in ROPE_INIT_FUNCTIONS:  # transformers 5 moved it into the model
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, their_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=length)
    ours, our_factor = rope_frequencies(ours_cfg, length)
    gap = ((theirs.double() - ours.double()).abs() / ours.double()).max().item() if theirs.shape == ours.shape else 1.0
    if gap > 1e-6 or abs(float(their_factor) - float(our_factor)) > 1e-6:
        ours_rope = f"{ours_cfg.get('rope_scaling')}, theta {ours_cfg.get('rope_theta')}"
        raise ConvertError(f"--verify: at {length:,} tokens the rope transformers reads from {what} ({kind}) differs "
                           f"from the checkpoint's ({ours_rope}): "
                           f"inverse frequencies {gap:.1e} apart, attention factor {float(their_factor):.4g} vs "
                           f"{float(our_factor):.4g}; nothing written")
    return length
