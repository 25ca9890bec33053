"""`make demo`: the UltraLong pipeline at toy scale on a laptop CPU.

At this stage of the project the demo validates the shipped recipes, builds the tiny
Llama-3.1-shaped Megatron-Core GPTModel on CPU (gloo, CPU backend) and trains it for a few steps
on a repeating token pattern, printing the loss. It grows into the full pipeline (convert ->
data -> CPT with YaRN and CP=2 -> SFT -> export -> NIAH) as those parts land.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from megatron_ext.model import build_model_from_recipe
    from megatron_ext.recipe import RecipeError, load_recipe
    from megatron_ext.runtime import destroy_distributed, init_distributed

    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    for path in recipes:
        try:
            load_recipe(path)
        except RecipeError as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 1
    print(f"[demo] {len(recipes)} recipes valid")

    recipe = load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["parallel.context=1", "cluster.gpus_per_node=1",
                                                         "train.seq_length=128", "rope={rope_type: default}"])
    init_distributed("cpu", seed=recipe.train.seed)
    model = build_model_from_recipe(recipe)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[demo] tiny Llama-3.1-shaped GPTModel on CPU: {n_params:,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, recipe.model.vocab_size, (16,), generator=gen)
    tokens = pattern.repeat(2, recipe.train.seq_length // 16)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    start = time.time()
    for step in range(1, 31):
        loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0:
            print(f"[demo] step {step:3d}  loss {loss.item():.4f}  ({time.time() - start:.1f}s)")
    destroy_distributed()
    if loss.item() > 1.0:
        print("[demo] loss did not fall below 1.0 on a repeating pattern", file=sys.stderr)
        return 1
    print("[demo] done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
