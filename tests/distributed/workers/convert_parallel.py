"""Worker: load a converted checkpoint at TP/PP > 1, report loss and full logits, re-save it.

    torchrun --nproc_per_node=N convert_parallel.py --root CKPT [--tp T] [--pp P]
        [--out FILE.json --logits FILE.safetensors] [--save ROOT2]

Loss/logits only at PP=1 (a pipelined forward needs the schedule; the trainer's tests cover it).
"""

from __future__ import annotations

import argparse
import json

import torch


def tokens_for(vocab: int, batch: int = 2, seq: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random tokens and next-token labels, the same in every process."""
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(123))
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_and_logits(model, tokens: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[float, torch.Tensor]:
    """Mean token loss and full-vocab logits `[b, s, vocab]` (gathered over TP, padding dropped)."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    with torch.no_grad():
        loss = model(tokens, pos, None, labels=labels).float().mean().item()
        local = model(tokens, pos, None)  # [b, s, vocab_padded / TP]
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return loss, torch.cat(parts, dim=-1)[..., :vocab].float().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--logits")
    ap.add_argument("--save")
    args = ap.parse_args()

    from megatron_ext.checkpoint import load_checkpoint, save_checkpoint
    from megatron_ext.checkpoint_layout import read_metadata
    from megatron_ext.model import BuildOptions, build_model
    from megatron_ext.runtime import destroy_distributed, init_distributed

    init_distributed("cpu", tensor=args.tp, pipeline=args.pp, seed=99)  # other init seed: weights come from disk
    meta = read_metadata(args.root)
    cfg = meta["hf_config"]
    model = build_model(cfg, BuildOptions(device="cpu", tensor=args.tp, pipeline=args.pp, precision="fp32",
                                          make_vocab_size_divisible_by=meta["vocab"]["make_vocab_size_divisible_by"],
                                          seq_length=48))
    iteration, _ = load_checkpoint(args.root, [model], weights_only=True)
    assert iteration == 0
    if args.out:
        tokens, labels = tokens_for(cfg["vocab_size"])
        loss, logits = loss_and_logits(model, tokens, labels, cfg["vocab_size"])
        if torch.distributed.get_rank() == 0:
            from safetensors.torch import save_file

            save_file({"logits": logits}, args.logits)
            with open(args.out, "w") as f:
                json.dump({"loss": loss}, f)
    if args.save:
        keep = {k: meta[k] for k in ("hf_config", "vocab", "source", "tokenizer", "generation_config") if k in meta}
        save_checkpoint(args.save, 5, [model], metadata=keep)
    destroy_distributed()


if __name__ == "__main__":
    main()
