"""Chunked loss head: the output projection and vocab-parallel cross entropy, a few thousand tokens at a time.

Megatron's loss head computes the logits of every token (`[s, b, V/TP]`, bf16) and an fp32 copy (6 B x V/TP per
token at the forward peak), and its cross entropy keeps the fp32 softmax for the backward pass (4 B x V/TP per
token): 94 GiB and 63 GiB at 128K tokens with Llama-3's 128,256-entry vocabulary at TP=1, more than all the layer
inputs kept under full recompute (docs/research/perf.md section 5b). Here the
logits of `chunk_tokens` tokens at a time are formed, reduced to a log-sum-exp and the target logit, and freed; the
backward pass forms them again, chunk by chunk, to get the softmax gradient. What stays alive between forward and
backward is the hidden state the output layer keeps anyway (under sequence parallelism only the local shard;
each chunk's rows are gathered from the TP ranks when used, in forward and again in backward) plus 4 B per token; the price is one more logits GEMM
(2 x h x V/TP FLOPs per token: 2.0% of Llama-3.1-8B's causal training FLOPs at 8K tokens, 0.7% at 128K).

The arithmetic follows Megatron's `vocab_parallel_cross_entropy` (bf16 logits upcast to fp32, max and sum-exp
all-reduced over the tensor-parallel group, padded vocabulary rows included), so losses agree with it to fp32
rounding; the weight gradient is summed over chunks in fp32: under Megatron's DDP straight into its fp32 `main_grad`
(as Megatron's fused-accumulation linears do): no fp32 accumulator and no fp32 copy of each chunk's product, 8 B x
V/TP x h (4.2 GB at TP=1 with Llama-3's vocabulary), and the gradient is rounded to bf16 once per chunk only.

`ChunkedLossGPTModel` plugs this into Megatron-Core's `GPTModel` where it turns hidden states into the loss
(`_postprocess`) whenever labels are given; logits (no labels), inference and multi-token prediction take
Megatron's own path unchanged. For evaluation it can instead return the final hidden states of a few positions
(`hidden_positions`), so that a multi-million-token forward never forms the logits of every token.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 2048


def _tp_rank_and_size(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _local_targets(labels: torch.Tensor, vocab_start: int, vocab_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each label in this rank's vocabulary slice (clamped) and whether it lies in the slice."""
    local = labels - vocab_start
    in_slice = (local >= 0) & (local < vocab_rows)
    return local.clamp(0, vocab_rows - 1), in_slice


def _gather_sequence(hidden: torch.Tensor, group) -> torch.Tensor:
    """[n, h] rows of every TP rank -> [TP x n, h], rank-major."""
    tp = dist.get_world_size(group)
    full = torch.empty((hidden.shape[0] * tp, *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
    dist.all_gather_into_tensor(full, hidden.contiguous(), group=group)
    return full


def _chunks(local_tokens: int, tp: int, sequence_parallel: bool, chunk_tokens: int, device):
    """Per chunk: the rows of this rank's input, and where the chunk's tokens sit in the full sequence.

    Under sequence parallelism each rank holds a contiguous 1/TP of the tokens; a chunk takes the same
    rows from every rank (gathered rank-major), so no rank ever holds more than one chunk of the sequence.
    """
    if not sequence_parallel:
        for start in range(0, local_tokens, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, local_tokens))
            yield rows, rows
        return
    step = max(1, chunk_tokens // tp)
    rank_offsets = torch.arange(tp, device=device).unsqueeze(-1) * local_tokens
    for start in range(0, local_tokens, step):
        end = min(start + step, local_tokens)
        yield slice(start, end), (rank_offsets + torch.arange(start, end, device=device)).reshape(-1)


def _ddp_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's fp32 gradient buffer of `weight` [V/TP, h], where the head may add its weight gradient itself.

    DDP gives each parameter a `main_grad` view of its buffer and a `grad_added_to_main_grad` flag; its backward
    hook adds `param.grad` into `main_grad` unless the flag is set (Megatron's own linears set it when a fused
    kernel accumulated the gradient already). None without DDP (evaluation, tests of the head alone).
    """
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        return None  # a buffer the head does not know how to add into (bf16 gradient reduce): DDP adds as usual
    return main_grad


def _placeholder_weight_grad(weight: torch.Tensor, product: torch.Tensor | None) -> torch.Tensor:
    """What backward returns for a weight whose gradient is already in DDP's `main_grad`: autograd must still
    reach the parameter (DDP's hook there marks its bucket ready), so a tensor of its shape, which the hook drops.

    Where the weight is also the input embedding on this stage (tied), autograd adds the embedding's gradient to
    this one and Megatron marks the weight `zero_out_wgrad`: its hook then adds the sum, so it must be zeros.
    """
    weight.grad_added_to_main_grad = True
    grad = product if product is not None else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return grad.zero_() if getattr(weight, "zero_out_wgrad", False) else grad


def _minus_fp32(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`logits` [c, V/TP] minus `shift` [c] per row, in fp32: in place when the logits are fp32 already; from bf16 in
    one pass (the subtraction upcasts; on a GPU inside the kernel), where a cast and then an in-place subtraction
    went over the fp32 logits twice. The same values either way."""
    if logits.dtype == torch.float32:
        return logits.sub_(shift.unsqueeze(-1))
    return torch.sub(logits, shift.unsqueeze(-1))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss[t] = logsumexp(h[t] @ W.T) - (h[t] @ W.T)[label[t]] with W split over TP ranks by vocabulary rows.

    Like Megatron's ColumnParallelLinear it owns the TP communication of its input: under sequence
    parallelism each chunk's rows are all-gathered (in forward and again in backward) and their input
    gradient reduce-scattered; otherwise the input gradient is all-reduced.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group,
                sequence_parallel: bool, chunk_tokens: int) -> torch.Tensor:
        # hidden [T, h] ([T/TP, h] under SP), weight [V/TP, h], labels [T] -> loss [T] fp32
        rank, tp = _tp_rank_and_size(group)
        sequence_parallel = sequence_parallel and tp > 1
        vocab_rows = weight.shape[0]
        loss = torch.empty(labels.shape[0], dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(loss)
        for rows, where in _chunks(hidden.shape[0], tp, sequence_parallel, chunk_tokens, hidden.device):
            h = _gather_sequence(hidden[rows], group) if sequence_parallel else hidden[rows]
            logits = h @ weight.t()  # [c, V/TP], the model's dtype
            row_max = logits.amax(dim=-1).float()  # exact in any dtype
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            shifted = _minus_fp32(logits, row_max)
            del logits
            target, in_slice = _local_targets(labels[where], rank * vocab_rows, vocab_rows)
            target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1) * in_slice  # nonzero on one rank
            sum_exp = shifted.exp_().sum(dim=-1)
            del shifted
            parts = torch.stack([target_logit, sum_exp], dim=-1)  # [c, 2]: one all-reduce for both
            _all_reduce(parts, dist.ReduceOp.SUM, group)
            log_sum = parts[:, 1].log()
            loss[where] = log_sum - parts[:, 0]
            logsumexp[where] = row_max + log_sum
        ctx.save_for_backward(hidden, weight, labels, logsumexp)
        ctx.group, ctx.sequence_parallel, ctx.chunk_tokens = group, sequence_parallel, chunk_tokens
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, logsumexp = ctx.saved_tensors
        group, sequence_parallel = ctx.group, ctx.sequence_parallel
        rank, tp = _tp_rank_and_size(group)
        vocab_rows = weight.shape[0]
        grad_hidden = torch.empty_like(hidden)
        into_main_grad = _ddp_main_grad(weight)
        # fp32 [V/TP, h]: DDP's buffer (the sum over microbatches), else our own
        grad_weight = into_main_grad if into_main_grad is not None else torch.zeros(
            weight.shape, dtype=torch.float32, device=weight.device)
        # bf16: each chunk's [V/TP, h] product lands here (reused) and is added in fp32; no fp32 copy of it
        product = None if grad_weight.dtype == hidden.dtype else torch.empty(weight.shape, dtype=hidden.dtype,
                                                                             device=weight.device)
        for rows, where in _chunks(hidden.shape[0], tp, sequence_parallel, ctx.chunk_tokens, hidden.device):
            h = _gather_sequence(hidden[rows], group) if sequence_parallel else hidden[rows]
            # softmax - one_hot(label), scaled by each token's incoming gradient: [c, V/TP]
            probs = _minus_fp32(h @ weight.t(), logsumexp[where]).exp_()
            target, in_slice = _local_targets(labels[where], rank * vocab_rows, vocab_rows)
            probs.scatter_add_(-1, target.unsqueeze(-1), -in_slice.to(probs.dtype).unsqueeze(-1))
            # the product written in the model's dtype (in place in fp32): one pass, not an fp32 product and its cast
            out = probs if hidden.dtype == probs.dtype else torch.empty(probs.shape, dtype=hidden.dtype,
                                                                        device=probs.device)
            grad_logits = torch.mul(probs, grad_loss[where].unsqueeze(-1), out=out)
            del probs, out
            if product is None:  # fp32: accumulate in place
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                grad_weight.add_(torch.mm(grad_logits.t(), h, out=product))
            # This rank's input gradient covers its vocabulary rows only: summed over the TP ranks.
            if sequence_parallel:
                mine = torch.empty_like(hidden[rows])
                dist.reduce_scatter_tensor(mine, grad_logits @ weight, group=group)
                grad_hidden[rows] = mine
            else:
                grad_hidden[rows] = grad_logits @ weight
            del grad_logits  # before the next chunk's logits exist: one chunk alive at a time
        if not sequence_parallel:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
        if into_main_grad is None:
            return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None
        return grad_hidden, _placeholder_weight_grad(weight, product), None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                        group=None, sequence_parallel: bool = False,
                                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                                        loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token cross entropy of `hidden @ weight.T` without materialising all the logits.

    hidden: [s, b, h] (the local sequence shard under sequence parallelism: [s/TP, b, h]);
    weight: [V/TP, h], this rank's rows of the output layer; labels: [b, s], all tokens on every TP rank.
    Returns the loss [b, s] in fp32, as `GPTModel.compute_language_model_loss` does. With `loss_mask` [b, s],
    tokens where it is 0 (SFT prompts, padding) get loss 0 and no logits at all (not under sequence
    parallelism, where each TP rank holds other tokens).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, s = labels.shape
    labels_sb = labels.transpose(0, 1).reshape(s * b)
    if loss_mask is not None and not (sequence_parallel and _tp_rank_and_size(group)[1] > 1):
        rows = loss_mask.transpose(0, 1).reshape(s * b).nonzero().squeeze(-1)  # [k], same on every TP rank
        if rows.numel() < s * b:
            kept = _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),
                                                    weight, labels_sb.index_select(0, rows), group, False,
                                                    chunk_tokens)
            loss = kept.new_zeros(s * b).index_put((rows,), kept)
            return loss.view(s, b).transpose(0, 1).contiguous()
    loss = _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels_sb, group,
                                            sequence_parallel, chunk_tokens)
    return loss.view(s, b).transpose(0, 1).contiguous()


@functools.cache
def chunked_loss_gpt_model_class():
    """`GPTModel` whose training loss goes through `vocab_parallel_linear_cross_entropy`.

    A (cached) factory so that importing this module does not import Megatron-Core.
    """
    from megatron.core.models.gpt import GPTModel

    class ChunkedLossGPTModel(GPTModel):
        """Megatron `GPTModel`; with labels, the loss head is chunked (`loss_chunk_tokens` tokens at a time) and
        skips the tokens a `loss_mask` given to `forward` zeroes."""

        loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
        # Evaluation: local sequence indices whose final (normed) hidden states the last stage returns, `[k, b, h]`,
        # in place of logits when no labels are given; None: Megatron's logits.
        hidden_positions: torch.Tensor | None = None

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
            if labels is None and self.hidden_positions is not None and self.post_process:
                if self.output_layer.sequence_parallel:  # each TP rank would hold only part of the rows
                    raise NotImplementedError("hidden_positions with sequence parallelism")
                return hidden_states.index_select(0, self.hidden_positions.to(hidden_states.device))
            megatron_path = (labels is None or not self.post_process or self.config.mtp_num_layers
                             or kwargs.get("mtp_in_postprocess") or kwargs.get("inference_context") is not None)
            if megatron_path:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            if self.share_embeddings_and_output_weights:
                weight = self.shared_embedding_or_output_weight()
            else:
                # The head reads the layer's weight without calling the layer, so run the layer's forward
                # pre-hooks here: under train.overlap_param_gather DDP's hook waits there for the weight's
                # all-gather (otherwise a stale slice is read, and the pending gather trips the next step).
                for hook in self.output_layer._forward_pre_hooks.values():
                    hook(self.output_layer, (hidden_states,))
                weight = self.output_layer.weight
            return vocab_parallel_linear_cross_entropy(
                hidden_states, weight, labels, group=self.pg_collection.tp,
                sequence_parallel=self.output_layer.sequence_parallel, chunk_tokens=self.loss_chunk_tokens,
                loss_mask=kwargs.get("loss_mask"))

    return ChunkedLossGPTModel
