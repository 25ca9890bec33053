"""Worker: the torch SDPA backend's core attention (`TorchSDPAttention`) on real gloo CP groups against SDPA over
the whole unsharded sequence (the oracle), causal and unmasked: the outputs and the gradients of Q, K and V (K's and
V's through the all-gather's reduce-scatter backward). CP=4, then CP=2 on the same 4 processes, two CP groups:
ranks 2 and 3 are CP ranks 0 and 1 of theirs.

    torchrun --nproc_per_node=4 cp_attention.py --out FILE
"""

import argparse
import json

import torch
import torch.nn.functional as F

from megatron_ext.attention import TorchSDPAttention
from megatron_ext.context_parallel import cp_positions
from megatron_ext.model import BuildOptions, transformer_config
from megatron_ext.presets import TINY
from megatron_ext.runtime import destroy_distributed, init_distributed

SEQ, BATCH = 48, 2
HEADS, GROUPS, DIM = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]


def check(cp: int) -> list[dict]:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    init_distributed("cpu", context=cp)
    group = parallel_state.get_context_parallel_group()
    config = transformer_config(TINY, BuildOptions(device="cpu", attention="sdpa", context=cp, seq_length=SEQ))
    gen = torch.Generator().manual_seed(7)  # the same whole sequence on every rank
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    weights = torch.randn(SEQ, BATCH, HEADS * DIM, generator=gen, dtype=torch.float64)  # loss: sum(out * weights)
    pos = cp_positions(SEQ, cp, group.rank())
    results = []
    for kind in (AttnMaskType.causal, AttnMaskType.no_mask):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in whole), scale=DIM ** -0.5,
                                             is_causal=kind == AttnMaskType.causal, enable_gqa=True)
        ref = ref.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * DIM)
        (ref * weights).sum().backward()
        local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
        out = TorchSDPAttention(config, 1, kind, "self")(*local)
        (out * weights[pos]).sum().backward()  # the whole loss is the sum of the ranks' parts
        errors = torch.stack([(out - ref[pos]).abs().max()] + [(mine.grad - theirs.grad[pos]).abs().max()
                                                                for mine, theirs in zip(local, whole)])
        torch.distributed.all_reduce(errors, op=torch.distributed.ReduceOp.MAX)
        results.append({"cp": cp, "kind": kind.name,
                        **dict(zip(("out", "dq", "dk", "dv"), errors.tolist()))})
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = check(4) + check(2)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
