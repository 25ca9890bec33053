"""Worker: the chunked loss head on TP ranks against a float64 cross entropy of the whole vocabulary.

    torchrun --nproc_per_node=2 loss_head_tp.py --out FILE [--sequence-parallel] [--wrong-slice]

Every rank draws the same hidden states [s, b, h], output weight [V, h] and labels, keeps its vocabulary rows
(and, under sequence parallelism, its sequence shard), and compares loss and gradients with the oracle. Some
labels sit on the vocabulary slices' boundaries. Under sequence parallelism it also records the rows of every
chunk the head gathers (observed through a wrapper around the head's gather; nothing changed).
"""

import argparse
import json
import os

import torch

from megatron_ext import loss_head
from megatron_ext.loss_head import vocab_parallel_linear_cross_entropy
from megatron_ext.runtime import destroy_distributed, init_distributed

CHUNK_TOKENS = 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--wrong-slice", action="store_true", help="negative control: every rank takes rank 0's rows")
    ap.add_argument("--logit-scale", type=float, default=1.0, help="output weight x this: logits in the hundreds")
    args = ap.parse_args()

    init_distributed("cpu", tensor=int(os.environ["WORLD_SIZE"]), seed=3)
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, tp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    s, b, h, vocab = 24, 2, 16, 64
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64) * 0.5 * args.logit_scale
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    # Each vocabulary slice's first and last rows: a label on a slice boundary must count on one rank only.
    boundaries = sorted({e for r in range(tp) for e in (r * vocab // tp, (r + 1) * vocab // tp - 1)})
    labels[0, :len(boundaries)] = torch.tensor(boundaries)
    upstream = torch.rand(b, s, generator=gen, dtype=torch.float64)  # d(objective)/d(loss[b, s])

    full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    oracle = torch.nn.functional.cross_entropy((full_h @ full_w.t()).reshape(s * b, vocab),
                                               labels.t().reshape(s * b), reduction="none").view(s, b).t()
    (oracle * upstream).sum().backward()

    rows = vocab // tp
    first = 0 if args.wrong_slice else rank * rows
    seq = s // tp
    my_h = (hidden[rank * seq:(rank + 1) * seq] if args.sequence_parallel else hidden).float().requires_grad_()
    my_w = weight[first:first + rows].float().requires_grad_()
    gathered_rows = []  # rows of each chunk gathered under SP: the memory bound is chunk_tokens, not TP x it

    def recording_gather(shard, group):
        full = gather(shard, group)
        gathered_rows.append(full.shape[0])
        return full

    gather, loss_head._gather_sequence = loss_head._gather_sequence, recording_gather
    loss = vocab_parallel_linear_cross_entropy(my_h, my_w, labels, group=group,
                                               sequence_parallel=args.sequence_parallel, chunk_tokens=CHUNK_TOKENS)
    (loss.double() * upstream).sum().backward()
    loss_head._gather_sequence = gather

    want_h = full_h.grad[rank * seq:(rank + 1) * seq] if args.sequence_parallel else full_h.grad
    errors = {
        "loss": (loss.double() - oracle.detach()).abs().max().item(),
        "grad_hidden": (my_h.grad.double() - want_h).abs().max().item(),
        "grad_weight": (my_w.grad.double() - full_w.grad[rank * rows:(rank + 1) * rows]).abs().max().item(),
    }
    gathered, rows_seen = [None] * tp, [None] * tp
    torch.distributed.all_gather_object(gathered, errors)
    torch.distributed.all_gather_object(rows_seen, gathered_rows)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"tp": tp, "ranks": gathered, "chunk_tokens": CHUNK_TOKENS, "gathered_rows": rows_seen,
                       "max_logit": (hidden @ weight.t()).abs().max().item()}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
