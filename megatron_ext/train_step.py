"""One training step's pieces on Megatron-Core's schedules: the forward step a schedule calls per microbatch, its
loss (a *sum* and a token count, so that `finalize_model_grads` divides by the global count), the step's reduced
loss, and the validation loss the same way. The loop that runs them is `megatron_ext.train`."""

from __future__ import annotations

from functools import partial

import torch

from megatron_ext.recipe import Recipe
from megatron_ext.runtime.distributed import rank_device


def loss_func(loss_mask: torch.Tensor, attention_pairs: int, output_tensor: torch.Tensor):
    """Loss *sum* over this microbatch's unmasked tokens, and their count (the schedule sums both); the report adds
    the (query, key) pairs its packed attention spans (0: not packed), for the FLOP count."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().double(), num_tokens.double(),
                          torch.tensor(float(attention_pairs), dtype=torch.float64, device=loss_sum.device)])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One microbatch through the model; batch tensors are `[b, s_local]` (already CP-sharded)."""
    batch = next(data_iterator)
    # loss_mask reaches the chunked loss head, which forms no logits for masked tokens (SFT prompts).
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"), loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], batch.get("attention_pairs", 0))


def reduce_loss(reports: list) -> tuple[float, int, int]:
    """Global token-mean loss of a step from the per-microbatch `[sum, count, attention pairs]` reports (which only
    the last pipeline stage has): summed over DP x CP, then sent to every pipeline stage (rank 0 writes the
    metrics). Returns the loss, the tokens it counts and the packed attention's pairs (0 unless SFT)."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(3, dtype=torch.float64, device=rank_device())
    for report in reports:
        total += report["lm loss"]
    torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(total, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item(), int(total[1].item()), int(total[2].item())


@torch.no_grad()
def validation_loss(forward_backward, model, batches, recipe: Recipe, num_microbatches: int) -> tuple[float, int]:
    """Token-mean loss over the first `train.eval_iters` global batches of the valid split (forward only, the
    training step's layout and loss), and the number of tokens it counts."""
    t = recipe.train
    model.eval()
    try:
        reports = []
        for k in range(t.eval_iters):
            reports += forward_backward(
                forward_step_func=forward_step, data_iterator=batches.iterator(k, num_microbatches), model=[model],
                num_microbatches=num_microbatches, seq_length=t.seq_length,
                micro_batch_size=t.micro_batch_size, forward_only=True)
    finally:
        model.train()
    return reduce_loss(reports)[:2]
