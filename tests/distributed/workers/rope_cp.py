"""Worker: CP-local RoPE tables on real gloo CP groups (CP=4, then CP=2 on the same 4 processes).

    torchrun --nproc_per_node=4 rope_cp.py --out FILE

Each rank checks that its table equals Megatron's `get_pos_emb_on_this_cp_rank` slice of the full
table; rank 0 gathers all local tables, rebuilds the CP=1 table in zigzag order and writes results.
"""

import argparse
import json

import torch

from megatron_ext.model import BuildOptions, transformer_config
from megatron_ext.presets import LLAMA31_8B
from megatron_ext.rope import ULTRALONG_ROPE, ScaledRotaryEmbedding, set_attention_factor
from megatron_ext.runtime import destroy_distributed, init_distributed

CFG = {**LLAMA31_8B, "rope_scaling": None, "rope_parameters": ULTRALONG_ROPE["ultralong-1m"],
       "max_position_embeddings": 1 << 20}
SEQ = 2048


def check(cp: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    init_distributed("cpu", context=cp)
    group = parallel_state.get_context_parallel_group()
    emb = ScaledRotaryEmbedding(CFG)  # takes Megatron's CP group, as GPTModel's embedding does
    config = transformer_config(CFG, BuildOptions(device="cpu", attention="sdpa", context=cp, seq_length=SEQ))
    set_attention_factor(config, emb)
    emb.bind(config)
    local = emb(SEQ)  # [SEQ/cp, 1, 1, 128]
    full = emb.local_table(SEQ)
    same_as_megatron = torch.equal(local, get_pos_emb_on_this_cp_rank(full, 0, group))
    gathered = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(gathered, local.contiguous(), group=group)
    halves = [g.chunk(2) for g in gathered]
    rebuilt = torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)])
    ok = torch.tensor([int(same_as_megatron), int(torch.equal(rebuilt, full)), int(local.shape[0] == SEQ // cp)])
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return {"cp": cp, "cp_rank": group.rank(), "megatron_slice": bool(ok[0]), "rebuilds_cp1": bool(ok[1]),
            "local_length": bool(ok[2])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = [check(4), check(2)]
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
