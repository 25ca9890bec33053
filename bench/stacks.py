"""The two stacks the GPU throughput benchmark times: ours (Megatron-Core via megatron_ext) and the peer
(transformers `LlamaForCausalLM`). Each has `batch(length, vocab, device, gen)`, `step(batch)` (one whole
optimizer step; returns a loss tensor read after timing) and `loss_value(out)`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class Settings:
    """What one benchmark invocation measures (filled from the command line)."""

    device: str
    preset: str
    layers: int | None
    lengths: list[int]
    recompute_from: int
    stacks: list[str]
    warmup: int
    iters: int
    long_step_s: float
    budget_s: float
    matmul_n: int
    profile_lengths: list[int]
    out: Path
    fallback_layers: int | None = 0  # None: per length, the most layers the planner fits on the GPU (auto)
    min_timed_s: float = 0.0
    loss_head: str = "chunked"  # ours: megatron_ext.loss_head (chunked) or Megatron's output layer + CE (full)
    partial_recompute: bool = False  # ours, after the main rows: also recompute only the first N layers (full:N)
    sdpa_kernel: str = "auto"  # ours: runtime.sdpa_kernel (auto: SDPA's own choice, what a recipe gets by default)
    gpu: str | None = None  # cost_model.GPUS key the planner and the datasheet peak use (None: the device's own)


def make_recipe(s: Settings, recompute: str):
    """The recipe whose model block, optimizer and DDP settings `train.py`'s helpers read.

    `recompute`: none, full, or full:N (full recompute of the first N layers, `train.recompute_layers`).
    """
    from megatron_ext.presets import PRESETS
    from megatron_ext.recipe import load_recipe

    recompute, _, layers = recompute.partition(":")

    native = PRESETS[s.preset]["max_position_embeddings"]
    model = {"preset": s.preset, "max_position_embeddings": max(native, max(s.lengths))}
    if s.layers is not None:
        model["num_hidden_layers"] = s.layers
    raw = {"name": "gpu_throughput", "model": model,
           "train": {"seq_length": max(s.lengths), "steps": 1000, "lr": 1e-5, "precision": "bf16",
                     "recompute": recompute, "recompute_layers": int(layers) if layers else None,
                     "loss_head": s.loss_head},
           "cluster": {"nodes": 1, "gpus_per_node": 1}, "runtime": {"device": s.device, "attention": "sdpa",
                                                                        "sdpa_kernel": s.sdpa_kernel}}
    return load_recipe(raw=raw, world_size=1)


# ---------------------------------------------------------------------------- the two stacks


class Ours:
    """Our stack: build_model + Megatron DDP + Megatron optimizer + forward_backward, as train.py."""

    name = "ours"

    def __init__(self, s: Settings, recompute: str):
        import torch
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_ext.hf_config import hf_config_from_recipe
        from megatron_ext.model import BuildOptions, build_model
        from megatron_ext.train import build_optimizer, wrap_ddp

        self.torch = torch
        recipe = make_recipe(s, recompute)
        opts = dataclasses.replace(BuildOptions.from_recipe(recipe), attention="sdpa", precision="bf16")
        self.model = build_model(hf_config_from_recipe(recipe), opts)
        self.ddp = wrap_ddp(recipe, self.model)
        self.model.config.finalize_model_grads_func = finalize_model_grads
        self.model.config.no_sync_func = self.ddp.no_sync
        self.optimizer, self.scheduler = build_optimizer(recipe, [self.ddp])
        self.forward_backward = get_forward_backward_func()
        inner = getattr(self.optimizer, "optimizer", None)
        self.info = {"optimizer": type(self.optimizer).__name__,
                     "inner_optimizer": type(inner).__name__ if inner is not None else None,
                     "inner_defaults": {k: v for k, v in (inner.defaults if inner is not None else {}).items()
                                        if k in ("foreach", "fused", "capturable")},
                     "transformer_impl": self.model.config.transformer_impl,
                     "loss_head": opts.loss_head, "loss_chunk_tokens": opts.loss_chunk_tokens}

    def batch(self, length: int, vocab: int, device: str, gen) -> dict:
        torch = self.torch
        tokens = torch.randint(0, vocab, (1, length), generator=gen).to(device)  # [b=1, s]
        return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                "position_ids": torch.arange(length, device=device).unsqueeze(0),
                "loss_mask": torch.ones(1, length, device=device)}

    def step(self, batch: dict):
        """One optimizer step; returns the loss [sum, count, pairs] tensor (read after timing)."""
        from megatron_ext.train_step import forward_step

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[self.ddp], num_microbatches=1,
            seq_length=batch["tokens"].shape[1], micro_batch_size=1, forward_only=False)
        self.optimizer.step()
        self.scheduler.step(increment=1)
        return reports[0]["lm loss"]

    @staticmethod
    def loss_value(out) -> float:
        return float(out[0] / out[1])


class Peer:
    """transformers LlamaForCausalLM training step: SDPA, bf16 weights, torch AdamW, grad clip 1.0."""

    name = "peer"

    def __init__(self, s: Settings, recompute: str):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from megatron_ext.hf_config import hf_config_from_recipe

        self.torch = torch
        cfg = LlamaConfig(**hf_config_from_recipe(make_recipe(s, recompute)), attn_implementation="sdpa",
                          use_cache=False)
        with torch.device(s.device):
            model = LlamaForCausalLM(cfg)
        self.model = model.to(torch.bfloat16).train()
        if recompute == "full":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The recipe's AdamW settings (train.py): lr, betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.info = {"optimizer": "torch.optim.AdamW (bf16 states, no fp32 master)",
                     "attn_implementation": self.model.config._attn_implementation,
                     "gradient_checkpointing": recompute == "full"}

    def batch(self, length: int, vocab: int, device: str, gen) -> dict:
        tokens = self.torch.randint(0, vocab, (1, length), generator=gen).to(device)
        return {"tokens": tokens}

    def step(self, batch: dict):
        loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss  # mean over s-1 tokens
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @staticmethod
    def loss_value(out) -> float:
        return float(out)


STACKS = {"ours": Ours, "peer": Peer}
