"""Logit check: transformers' LlamaForCausalLM and our Megatron model on the same random tokens (fp32)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ext.convert.hf_io import ConvertError


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits `[b, s, vocab]` of the HF folder in float32 (eager attention)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(root: str | Path, tokens: torch.Tensor, iteration: int | None = None,
                    hf_config: dict | None = None) -> torch.Tensor:
    """Our Megatron model's logits `[b, s, vocab]` (padding rows dropped) loaded from a checkpoint root, fp32.

    The architecture (and RoPE) comes from the checkpoint metadata unless `hf_config` is given.
    Needs a TP=1, PP=1 parallel state.
    """
    from megatron_ext.checkpoint import load_checkpoint, read_metadata, resolve_iteration_dir
    from megatron_ext.model import BuildOptions, build_model, normalize_hf_config

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
    b, s = tokens.shape
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), None)
    return logits[..., : cfg["vocab_size"]].float()


def random_tokens(vocab_size: int, batch: int = 2, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def compare_logits(hf_dir: str | Path, megatron_root: str | Path, iteration: int | None = None, *,
                   batch: int = 2, seq_len: int = 32, seed: int = 0) -> float:
    """Max |logit difference| of the HF folder vs the Megatron checkpoint on random tokens (fp32)."""
    import json

    from megatron_ext.convert.staging import ensure_cpu_process_group

    ensure_cpu_process_group()
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(vocab, batch, seq_len, seed)
    diff = (hf_logits(hf_dir, tokens) - megatron_logits(megatron_root, tokens, iteration)).abs().max().item()
    print(f"verify: max |logit diff| HF vs Megatron = {diff:.3e} (fp32, {batch}x{seq_len} random tokens)")
    return diff
