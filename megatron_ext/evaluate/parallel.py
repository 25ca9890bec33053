"""NIAH and perplexity on the Megatron model itself, split over TP x PP x CP ranks: contexts no GPU holds alone.

A Hugging Face model keeps a 1M-token prompt's KV cache on one device (128 GiB for Llama-3.1-8B in bf16) and a
4M one not at all. Here the checkpoint is evaluated the way it was trained: the prompt is cut into zigzag CP
chunks and run through Megatron-Core's forward-only schedule with the training layout's attention (TE's CP
attention on GPUs, the torch SDPA all-gather backend elsewhere). That pass leaves each layer's keys and values on
the CP ranks that computed them, and each further token is a decode step over that token alone
(`kv_cache.py`). Decoding is greedy with a draft: the prompt's pass runs over the prompt followed by the expected
answer and keeps the model's own choices as far as they agree with the draft (speculative decoding with the answer
as the draft model), so a model that retrieves the needle needs no decode step at all. The output is exactly the
greedy continuation whatever the draft; decoding stops once the first number of the answer is complete, which is
all the score reads (`number_settled`). Perplexity by position is one forward pass per document with labels,
through the chunked loss head (`MegatronTokenLosses`).

    torchrun --nproc-per-node 8 tools/niah.py --megatron CKPT --engine megatron --cp 8 --lengths 1M --out runs/niah
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_ext.eval_plan import MIN_SHARED_PREFIX
from megatron_ext.evaluate.engine import megatron_engine
from megatron_ext.evaluate.errors import RankError
from megatron_ext.evaluate.speculative import speculative_greedy
from megatron_ext.log_lines import log_line
from megatron_ext.progress import progress_bar


def _padded_length(n: int, cp: int) -> int:
    """Sequences split into 2 x CP chunks: padded at the end, which no earlier position sees (causal)."""
    return -(-n // (2 * cp)) * (2 * cp)


def forward_only(model, batch: dict[str, torch.Tensor], seq_length: int | None = None) -> list:
    """One micro-batch (`[1, s / CP]` tokens, position_ids, optional labels) through Megatron's forward-only
    schedule; returns what the last pipeline stage's model gave (`[output]`), `[]` on other stages.
    `seq_length`: the global length whose CP share the pipeline stages send (default: CP x the batch's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_length = seq_length or batch["tokens"].shape[1] * ps.get_context_parallel_world_size()

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        return model(b["tokens"], b["position_ids"], None, labels=b.get("labels")), lambda out, non_loss_data=True: out

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=1, forward_only=True, collect_non_loss_data=True)


class MegatronGreedy:
    """NIAH `generate` function on a Megatron model built for this rank (parallel state initialised).

    Called on every rank with the same prompts `[B, L]` and drafts; the data-parallel replicas share the
    rows (replica d takes rows d, d + DP, ...), each row runs alone (micro-batch 1), and every rank returns
    every row's new ids. With `kv_cache` (default), the prompt's pass keeps its keys and values on the CP ranks
    and each further token is a decode step over that token alone (`kv_cache.py`); the cache is kept from row to
    row, and a prompt that shares at least `min_shared` of its tokens with the cached one (NIAH depths of one
    length share the haystack before the needle) runs only the rest (an extension pass). Without, every step is a
    pass over the whole sequence. `passes` counts the full passes this rank's replica ran, `extensions` the
    extension passes (`shared_tokens` the prompt tokens they did not run), `decode_steps` the others.
    """

    takes_drafts = True
    max_decode_tokens = 64  # a step over more new tokens than this is a full pass (or an extension)
    min_shared = MIN_SHARED_PREFIX

    def __init__(self, model, vocab_size: int, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
                 settled: Callable[[list[int]], bool] | None = None, device: torch.device | None = None,
                 kv_cache: bool = True):
        from megatron.core import parallel_state as ps

        from megatron_ext.evaluate.kv_cache import ContextParallelKVCache

        self.model, self.vocab_size = model, vocab_size
        self.max_new_tokens, self.eos, self.settled = max_new_tokens, tuple(eos_token_ids), settled
        self.device = device or torch.device("cpu")
        self.cp, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.tp_group, self.tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
        self.tp_cp_group = ps.get_tensor_and_context_parallel_group()
        self.pp_group, self.last_stage = ps.get_pipeline_model_parallel_group(), ps.is_pipeline_last_stage()
        self.dp_group = ps.get_data_parallel_group()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        # RoPE whose table depends on the whole length (dynamic, longrope) cannot extend a cache position by position
        self.cache = (ContextParallelKVCache(model) if kv_cache and not model.rotary_pos_emb.length_dependent
                      else None)
        self.passes = self.extensions = self.shared_tokens = self.decode_steps = 0

    @torch.no_grad()
    def predict(self, ids: list[int], first: int, known_same: int = 0) -> list[int]:
        """Greedy next token after positions `first .. len(ids) - 1`: a decode step over the tokens after the
        cached ones where the cache holds the sequence up to `first`, an extension pass where it holds enough of
        its start, else a pass over the whole sequence. `known_same`: leading positions the caller knows are those
        of the last call's `ids` (a row's prompt after its first pass)."""
        if self.cache is None:
            return self._prefill(ids, first)
        start = self.cache.reusable_prefix(ids, first, self.max_decode_tokens, known_same)
        if start is not None:
            preds = self._decode(ids, first, start)
            del self.cache.ids[start:]  # in place: a copy of a 4M-token list costs more than the GPU's decode step
            self.cache.ids += ids[start:]
            return preds
        shared = self.cache.shared_prefix(ids, first)
        if shared < self.min_shared * len(ids):
            self.cache.clear()  # before the pass: the old cache would sit beside the new one
            shared = 0
        preds = self._prefill(ids, first, shared)
        self.cache.ids = list(ids)
        return preds

    def _prefill(self, ids: list[int], first: int, start: int = 0) -> list[int]:
        """A pass over the tokens from `start` (an extension of the cached positions before it, if > 0)."""
        from megatron_ext.context_parallel import cp_positions, shard_for_context_parallel

        n = len(ids)
        length = _padded_length(n - start, self.cp)
        tokens = torch.zeros(1, length, dtype=torch.long)
        tokens[0, :n - start] = torch.tensor(ids[start:])
        batch = shard_for_context_parallel({"tokens": tokens, "position_ids": start + torch.arange(length)[None]},
                                           self.cp, self.cp_rank)
        positions = start + cp_positions(length, self.cp, self.cp_rank)  # global positions of this rank's rows
        mine = ((positions >= first) & (positions < n)).nonzero().flatten()  # local rows this CP rank holds
        if self.cache is None:
            recording = nullcontext()
        elif start:
            recording = self.cache.extending(start, positions.to(self.device), n)
        else:
            recording = self.cache.recording(positions.to(self.device), n)
        with recording:
            hidden = self._forward(batch, length, mine)
        if start:
            self.extensions, self.shared_tokens = self.extensions + 1, self.shared_tokens + start
        else:
            self.passes += 1
        return self._greedy_tokens(hidden, positions[mine] - first, n - first, writer=self.tp_rank == 0)

    def _decode(self, ids: list[int], first: int, start: int) -> list[int]:
        new = len(ids) - start  # tokens at positions start .. len(ids) - 1, the same on every CP rank
        batch = {"tokens": torch.tensor([ids[start:]]), "position_ids": torch.arange(start, len(ids))[None]}
        rows = torch.arange(first - start, new)
        with self.cache.decoding(start, new):
            hidden = self._forward(batch, new * self.cp, rows)
        self.decode_steps += 1
        return self._greedy_tokens(hidden, rows - (first - start), len(ids) - first,
                                   writer=self.tp_rank == 0 and self.cp_rank == 0)

    def _forward(self, batch: dict[str, torch.Tensor], seq_length: int, rows: torch.Tensor) -> list:
        self.model.hidden_positions = rows
        try:
            return forward_only(self.model, {k: v.to(self.device) for k, v in batch.items()}, seq_length)
        finally:
            self.model.hidden_positions = None

    def _greedy_tokens(self, hidden: list, slots: torch.Tensor, count: int, writer: bool) -> list[int]:
        """The argmax token of each row the last stage returned, at `slots` of a `[count]` list on every rank."""
        preds = torch.zeros(count, dtype=torch.long, device=self.device)  # next token + 1, 0 = not mine
        if self.last_stage:
            rows = hidden[0][:, 0]  # [k, h], normed final hidden states of this rank's positions
            weight = (self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights
                      else self.model.output_layer.weight)  # [V / TP, h]
            logits = rows.to(weight.dtype) @ weight.t()
            if dist.get_world_size(self.tp_group) > 1:
                parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
                dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
                logits = torch.cat(parts, dim=-1)
            best = logits[:, :self.vocab_size].float().argmax(-1)  # padded vocabulary rows never win
            if writer:
                preds[slots.to(self.device)] = best + 1
        dist.all_reduce(preds, group=self.tp_cp_group)
        dist.all_reduce(preds, group=self.pp_group)
        return (preds - 1).tolist()

    def _greedy_row(self, prompt: list[int], draft: Sequence[int]) -> list[int]:
        passes = 0

        def predict(ids: list[int], first: int) -> list[int]:  # after the row's first pass its prompt is cached
            nonlocal passes
            preds = self.predict(ids, first, known_same=len(prompt) if passes else 0)
            passes += 1
            return preds

        try:
            return speculative_greedy(predict, prompt, draft, self.max_new_tokens, self.eos, self.settled)[0]
        except torch.OutOfMemoryError:
            # Not retried in smaller batches (run_niah's answer to OOM on one device): the other ranks are inside
            # this pass's collectives. The job ends, the launcher stops the other ranks.
            raise RankError(f"rank {dist.get_rank()}: out of memory on a {len(prompt):,}-token prompt "
                            f"({len(prompt) // self.cp:,} tokens per rank): raise --cp (or --tp), or use shorter "
                            "--lengths (tools/plan.py RECIPE --eval LENGTHS shows what fits)") from None

    def __call__(self, prompts: torch.Tensor, drafts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """New ids per row of `prompts` (`[B, L]`, or rows of any lengths), greedy (draft i checked against row i when
        given)."""
        # Only this replica's rows become lists: a 4M-token row is ~150 MB of Python ints, and every rank of a node
        # held all DP rows' copies at once
        n_rows = len(prompts)
        drafts = drafts or [[] for _ in range(n_rows)]
        mine = {}
        for i in range(self.dp_rank, n_rows, self.dp):
            row = prompts[i].tolist() if isinstance(prompts, torch.Tensor) else list(prompts[i])  # any lengths
            try:
                mine[i] = self._greedy_row(row, drafts[i])
            except BaseException:
                if self.cache is not None:
                    self.cache.clear()  # a pass that failed leaves some layers' caches updated, others not
                raise
        everyone: list[dict] = [{} for _ in range(self.dp)]
        dist.all_gather_object(everyone, mine, group=self.dp_group)
        merged = {k: v for part in everyone for k, v in part.items()}
        return [merged[i] for i in range(n_rows)]


class MegatronTokenLosses:
    """Per-token loss of a document on a Megatron model (parallel state initialised; the same call on every rank).

    `losses(ids [T])` -> `[T - 1]` fp32 on the CPU, entry t-1 the loss of token t: one forward pass with labels
    through the chunked loss head, the CP ranks' zigzag chunks put back in order (what
    `perplexity.token_losses` gives for an HF model).
    """

    def __init__(self, model, device: torch.device | None = None):
        from megatron.core import parallel_state as ps

        self.model, self.device = model, device or torch.device("cpu")
        self.cp, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.cp_group, self.pp_group = ps.get_context_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.last_stage = ps.is_pipeline_last_stage()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from megatron_ext.context_parallel import shard_for_context_parallel, unshard

        n = len(ids)
        length = _padded_length(n, self.cp)
        tokens = torch.zeros(1, length, dtype=torch.long)
        tokens[0, :n] = ids.cpu()
        labels = torch.zeros_like(tokens)
        labels[0, :n - 1] = tokens[0, 1:n]
        batch = shard_for_context_parallel({"tokens": tokens, "labels": labels,
                                            "position_ids": torch.arange(length)[None]}, self.cp, self.cp_rank)
        out = forward_only(self.model, {k: v.to(self.device) for k, v in batch.items()})
        losses = torch.zeros(length, dtype=torch.float32, device=self.device)
        if self.last_stage:
            local = out[0].float().reshape(-1).contiguous()  # [s / CP], this rank's chunks
            if self.cp > 1:
                parts = [torch.empty_like(local) for _ in range(self.cp)]
                dist.all_gather(parts, local, group=self.cp_group)
                local = unshard(torch.cat(parts), self.cp)
            losses = local
        dist.all_reduce(losses, group=self.pp_group)  # the last stage's numbers to every stage
        return losses[:n - 1].cpu()


def run_niah_megatron(checkpoint, lengths, depths, *, tensor: int = 1, pipeline: int = 1, context: int = 1,
                      device: str | None = None, dtype: str | None = None, tokenizer=None, max_new_tokens: int = 16,
                      kv_cache: bool = True, on_progress=None, progress: bool = True, **niah_kwargs):
    """`run_niah` on a Megatron checkpoint over this job's ranks (see `engine.megatron_engine`; `kv_cache`: see
    `MegatronGreedy`).

    Every rank runs it; rank 0 gets `on_progress`, the progress bar and the log. Returns the grid on
    every rank.
    """
    from megatron_ext.evaluate.niah import run_niah

    with megatron_engine(checkpoint, tensor=tensor, pipeline=pipeline, context=context, device=device, dtype=dtype,
                         tokenizer=tokenizer) as engine:
        generate = engine.greedy(max_new_tokens, kv_cache=kv_cache)
        longest = engine.announce("niah", lengths, generate, niah_kwargs.get("allow_beyond_max_positions", False))
        result = run_niah(None, engine.tokenizer, lengths, depths, generate=generate, max_new_tokens=max_new_tokens,
                          **engine.run_arguments(longest, on_progress, progress), **niah_kwargs)
        engine.record(result.settings, generate)
        return result


def run_ppl_megatron(checkpoint, *, texts=None, documents=None, tensor: int = 1, pipeline: int = 1, context: int = 1,
                     device: str | None = None, dtype: str | None = None, tokenizer=None, progress: bool = True,
                     **ppl_kwargs):
    """`perplexity_by_position` of a Megatron checkpoint over this job's ranks; the data-parallel replicas share
    the documents (replica d takes documents d, d + DP, ...).

    `documents`: token-id documents (e.g. `indexed_documents(...)`), else `texts` with the tokenizer. Returns the
    result on every rank.
    """
    from megatron_ext.evaluate.perplexity import perplexity_by_position

    with megatron_engine(checkpoint, tensor=tensor, pipeline=pipeline, context=context, device=device, dtype=dtype,
                         tokenizer=tokenizer, needs_tokenizer=documents is None) as engine:
        if engine.rank0:
            log_line(f"[ppl] {engine.describe()}")
        source = documents if documents is not None else engine.tokenizer
        losses = MegatronTokenLosses(engine.model, engine.device)
        shares: list[int] = []

        def documents_losses(docs: list[torch.Tensor]) -> list[torch.Tensor]:
            merged, shares[:] = _replica_losses(losses, docs, progress)
            return merged

        result = perplexity_by_position(None, source, texts=texts, progress=False,
                                        documents_losses_fn=documents_losses,
                                        max_position_embeddings=engine.hf_config.get("max_position_embeddings"),
                                        chunk=None, **ppl_kwargs)
        result.settings.update(engine="megatron", layout=engine.layout, dtype=engine.precision,
                               documents_per_replica=shares)
        return result


def _replica_losses(losses: MegatronTokenLosses, docs: list[torch.Tensor],
                    progress: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Every document's token losses on every rank, each document run by one data-parallel replica; and how many
    documents each replica ran (the record that they shared the work rather than each doing all of it)."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = range(dp_rank, len(docs), dp)
    if progress and dist.get_rank() == 0:
        mine = progress_bar(mine, desc="ppl", unit="doc")
    done = {i: losses(docs[i]) for i in mine}
    everyone: list[dict] = [done]
    if dp > 1:
        everyone = [{} for _ in range(dp)]
        dist.all_gather_object(everyone, done, group=ps.get_data_parallel_group())
    merged = {i: t for part in everyone for i, t in part.items()}
    return [merged[i] for i in range(len(docs))], [len(part) for part in everyone]
