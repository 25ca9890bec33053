"""The demo's "released" base model: a tiny Llama-3.1-shaped model trained at 256 tokens.

It plays the part of Meta's Llama-3.1-8B-Instruct (trained at 128K): a Hugging Face checkpoint
that the pipeline then converts, extends and evaluates with the project's real tools. Meta's
pretraining is not the project's subject, so this is a plain PyTorch loop over transformers'
`LlamaForCausalLM` (the outside oracle the converter checks against anyway).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_ext.demo.corpus import demo_corpus
from megatron_ext.hf_config import normalize_hf_config
from megatron_ext.presets import TINY_DEMO
from megatron_ext.progress import progress_bar, quiet_library_bars


def recall_weights(ids: list[int], digit_ids: set[int], weight: float) -> list[float]:
    """Per-token loss weights of one document: `weight` on the digits of a number that already
    appeared earlier in it (the recalled needle value or key code), 1 elsewhere.

    Meta's pretraining is not ours to reproduce; weighting recalls is how the stand-in base learns
    retrieval in a few hundred CPU steps instead of the millions of steps an LM would take.
    """
    out = [1.0] * len(ids)
    seen: set[tuple[int, ...]] = set()
    i = 0
    while i < len(ids):
        if ids[i] not in digit_ids:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] in digit_ids:
            j += 1
        run = tuple(ids[i:j])
        if run in seen:
            out[i:j] = [weight] * (j - i)
        seen.add(run)
        i = j
    return out


def documents(tokenizer, seed: int, min_sentences: int, max_sentences: int, recall_weight: float = 1.0,
              kv_every: int = 2, length_power: float = 1.0) -> Iterator[tuple[list[int], list[float]]]:
    """Endless (token ids, loss weights) of `<|begin_of_text|>` + document (deterministic in `seed`)."""
    # Digit tokens, with and without a leading space (the demo tokenizer keeps it on a number's first digit).
    digit_ids = {i for d in range(10) for t in (str(d), f" {d}")
                 for i in tokenizer(t, add_special_tokens=False)["input_ids"][-1:]}
    for doc in demo_corpus(1 << 40, seed, min_sentences, max_sentences, kv_every=kv_every,
                           length_power=length_power):
        ids = [tokenizer.bos_token_id] + tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
        yield ids, recall_weights(ids, digit_ids, recall_weight)


def doc_batch(docs: Iterator[tuple[list[int], list[float]]], batch_size: int, seq_length: int, pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One document per row (cut to `seq_length`), right-padded to the longest row with weight 0.

    One per row, not packed: with several needles in a row the question would be ambiguous (every
    document uses the same needle sentence). Returns ids [B, S] and target weights [B, S-1].
    """
    rows = [next(docs) for _ in range(batch_size)]
    rows = [(ids[:seq_length], w[:seq_length]) for ids, w in rows]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    weight = torch.zeros(batch_size, width)
    for b, (r_ids, r_w) in enumerate(rows):
        ids[b, :len(r_ids)] = torch.tensor(r_ids)
        weight[b, :len(r_w)] = torch.tensor(r_w)
    return ids, weight[:, 1:]


def train_base(out_dir: str | Path, tokenizer_dir: str | Path, *, steps: int, batch_size: int = 16,
               seq_length: int = 256, lr: float = 3e-3, seed: int = 0, recall_weight: float = 10.0,
               kv_every: int = 2, min_sentences: int = 0, max_sentences: int = 22, length_power: float = 2.0,
               init_from: str | Path | None = None, log=print) -> dict:
    """Train the tiny-demo model at `seq_length` tokens and save it (+ tokenizer) as an HF folder.

    One document per row (0-22 filler sentences, mostly short: `length_power`), loss weighted
    `recall_weight` on recalled numbers (see `recall_weights`). Returns {"steps", "final_loss",
    "seconds"}. Written to a temporary folder and renamed into place when complete.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    # a deep copy: transformers 5 writes rope_theta into the rope_scaling dict it is given (the preset's, otherwise)
    cfg_dict = copy.deepcopy(dict(TINY_DEMO, max_position_embeddings=seq_length, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id))
    if len(tok) > cfg_dict["vocab_size"]:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens > tiny-demo vocab_size {cfg_dict['vocab_size']}")
    cfg = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    torch.manual_seed(seed)
    # init_from: continue from an earlier base (HF folder), e.g. to lengthen a run without redoing it.
    quiet_library_bars()
    model = LlamaForCausalLM(cfg) if init_from is None else LlamaForCausalLM.from_pretrained(str(init_from))
    docs = documents(tok, seed + 1, min_sentences, max_sentences, recall_weight, kv_every, length_power)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 15)
    # Linear warmup, cosine decay to 10% (the usual pretraining schedule).
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    t0 = time.time()
    loss_ema = None
    bar = progress_bar(range(steps), desc="base", unit="step", mininterval=2.0)
    for _ in bar:
        batch, weight = doc_batch(docs, batch_size, seq_length, tok.pad_token_id)  # [B, S], [B, S-1]
        logits = model(input_ids=batch).logits[:, :-1]  # [B, S-1, V]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
        loss = (nll * weight.flatten()).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    bar.close()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    # transformers 5 writes the rope as `rope_parameters` alone, which 4.56-4.57 ignore (plain RoPE, no warning): the
    # folder gets the transformers-4 form every supported version reads, as tools/convert.py's exports do
    config = tmp / "config.json"
    config.write_text(json.dumps(normalize_hf_config(json.loads(config.read_text())), indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    info = {"steps": steps, "final_loss": loss_ema, "seconds": round(time.time() - t0, 1)}
    log(f"[demo] base trained: {steps} steps x {batch_size} x {seq_length} tokens, loss {loss_ema:.3f} "
        f"({info['seconds']:.0f}s)")
    return info
