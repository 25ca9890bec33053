"""Worker: tiny Llama loss at a given TP size on fixed weights (saved or loaded as a dist checkpoint).

    torchrun --nproc_per_node=TP tp_loss.py --tp TP {--save DIR | --load DIR} --out FILE [--perturb]
        [--loss-head chunked|full] [--loss-chunk-tokens N]

Writes the mean loss and the gradient norm of the tensor-parallel weights (all-reduced over TP ranks).
"""

import argparse
import json

import torch

from megatron_ext.model import build_model_from_recipe
from megatron_ext.recipe import load_recipe
from megatron_ext.runtime import destroy_distributed, init_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--out", required=True)
    ap.add_argument("--perturb", action="store_true", help="negative control: change one weight after loading")
    ap.add_argument("--loss-head", default="chunked")
    ap.add_argument("--loss-chunk-tokens", type=int, default=2048)
    args = ap.parse_args()

    from megatron.core import dist_checkpointing

    recipe = load_recipe(raw={
        "model": {"preset": "tiny"}, "parallel": {"tensor": args.tp},
        "train": {"seq_length": 64, "steps": 1, "lr": 1e-3, "precision": "fp32", "loss_head": args.loss_head,
                  "loss_chunk_tokens": args.loss_chunk_tokens},
        "runtime": {"device": "cpu"}, "cluster": {"nodes": 1, "gpus_per_node": args.tp},
    })
    init_distributed("cpu", tensor=args.tp, seed=7)
    model = build_model_from_recipe(recipe)
    if args.save:
        import os

        os.makedirs(args.save, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), args.save)
    if args.load:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), args.load))
    if args.perturb:
        with torch.no_grad():
            model.decoder.layers[0].mlp.linear_fc2.weight[0, 0] += 0.5

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (2, 64), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(64).expand(2, 64)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    # Split weights only: each rank holds all of a replicated weight's gradient (counting it TP times).
    split_sq = sum(p.grad.double().pow(2).sum() for p in model.parameters()
                   if getattr(p, "tensor_model_parallel", False))
    torch.distributed.all_reduce(split_sq)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"loss": loss.item(), "split_grad_norm": split_sq.sqrt().item()}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
