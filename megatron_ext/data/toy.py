"""Offline toy data: a tiny Llama-3-like tokenizer and synthetic corpora with recallable facts.

Used by the tests, the CPU demo and the benchmarks; nothing here touches the network.

- `build_toy_tokenizer(out_dir)` trains a small byte-level BPE with the `tokenizers` library and
  saves it as a Hugging Face tokenizer folder (`AutoTokenizer.from_pretrained(out_dir)` loads it)
  with Llama-3's special tokens and a Llama-3.1-style chat template. As in Llama-3, the text
  `<s>` is *not* a special token, so the paper's `<s>` separator is ordinary text.
- `synthetic_corpus(n_docs, seed)` yields documents `{"id", "source", "text"}` whose text states
  key-value facts early ("The code of the blue falcon is 4821.") and asks for them later
  ("Question: what is the code of the blue falcon? Answer: 4821."), separated by filler. Lengths
  vary per source, so per-source length upsampling has something to act on.
- `synthetic_chats(n, seed)` yields chat samples `{"messages": [...]}` for SFT.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron_ext.data.chat import LLAMA31_CHAT_TEMPLATE
from megatron_ext.evaluate.io import current_umask, write_atomic

# Llama-3's special tokens, same names (ids differ: the toy vocabulary is tiny).
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|finetune_right_pad_id|>"]

_ADJ = ["blue", "red", "quiet", "rapid", "golden", "hidden", "northern", "silver", "ancient", "bright",
        "lonely", "frozen", "crimson", "gentle", "hollow", "iron"]
_NOUN = ["falcon", "river", "lantern", "harbor", "orchard", "engine", "meadow", "tower", "glacier",
         "violin", "compass", "garden", "canyon", "beacon", "forest", "mirror"]
_FILLER = ["the", "grass", "is", "green", "and", "sky", "blue", "today", "people", "walk", "along",
           "road", "while", "birds", "sing", "in", "trees", "near", "old", "house", "water", "flows",
           "slowly", "under", "bridge", "every", "morning", "light", "comes", "over", "hills", "town"]

# Per-source document length ranges in filler words; the classes straddle the paper's 4K/8K token
# thresholds once scaled (tests scale thresholds down to the toy lengths).
DEFAULT_SOURCES: dict[str, tuple[int, int]] = {"web": (20, 120), "book": (300, 900), "code": (60, 400)}


def build_toy_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on synthetic text and save it as an HF tokenizer folder; return the path.

    Deterministic: the same `vocab_size` gives the same `tokenizer.json`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    train_text = [d["text"] for d in synthetic_corpus(60, seed=0)]
    train_text += [m["content"] for c in synthetic_chats(40, seed=0) for m in c["messages"]]
    tok.train_from_iterator(train_text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>")
    fast.chat_template = LLAMA31_CHAT_TEMPLATE
    # saved beside `out`, then renamed into place: an interrupted run leaves no half-written tokenizer folder
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's 0700: the folder a plain mkdir would make
        fast.save_pretrained(str(staging))
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _fact(rng: random.Random) -> tuple[str, str]:
    return f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}", str(rng.randrange(1000, 10000))


def _filler(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_FILLER) for _ in range(n_words)]
    # Sentences of ~12 words keep the BPE merges realistic.
    return " ".join(w.capitalize() + "." if i % 12 == 11 else w for i, w in enumerate(words))


def synthetic_document(rng: random.Random, n_words: int, n_facts: int = 2) -> str:
    """One document of about `n_words` filler words with `n_facts` facts stated early, recalled late."""
    facts = [_fact(rng) for _ in range(n_facts)]
    head = " ".join(f"The code of the {k} is {v}." for k, v in facts)
    tail = " ".join(f"Question: what is the code of the {k}? Answer: {v}." for k, v in facts)
    return f"{head} {_filler(rng, n_words)} {tail}"


def synthetic_corpus(n_docs: int, seed: int = 0,
                     sources: dict[str, tuple[int, int]] | None = None) -> Iterator[dict]:
    """Yield `n_docs` documents `{"id": int, "source": str, "text": str}` (deterministic in `seed`).

    `sources` maps a source name to its (min, max) filler-word count; documents cycle through the
    sources in order, lengths uniform in the range.
    """
    rng = random.Random(seed)
    srcs = list((sources or DEFAULT_SOURCES).items())
    for i in range(n_docs):
        name, (lo, hi) = srcs[i % len(srcs)]
        yield {"id": i, "source": name, "text": synthetic_document(rng, rng.randint(lo, hi))}


def synthetic_chats(n: int, seed: int = 0, no_assistant_every: int = 0) -> Iterator[dict]:
    """Yield `n` chat samples `{"messages": [{"role", "content"}, ...]}` (1-3 user/assistant turns,
    sometimes a system prompt). With `no_assistant_every=k`, every k-th sample has no assistant turn."""
    rng = random.Random(seed)
    for i in range(n):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": "You answer questions about codes."})
        for _ in range(rng.randint(1, 3)):
            k, v = _fact(rng)
            msgs.append({"role": "user", "content": f"The code of the {k} is {v}. {_filler(rng, rng.randint(3, 30))} "
                                                    f"What is the code of the {k}?"})
            msgs.append({"role": "assistant", "content": f"The code of the {k} is {v}."})
        if no_assistant_every and i % no_assistant_every == no_assistant_every - 1:
            msgs = [m for m in msgs if m["role"] != "assistant"]
        yield {"messages": msgs}


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    """Write records as JSON lines (UTF-8), under a temporary name renamed into place; return the path."""
    def write(f) -> None:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    return write_atomic(path, write)


def write_toy_inputs(out_dir: str | Path, documents: int = 300, chats: int = 200, seed: int = 0) -> dict[str, Path]:
    """The offline inputs of the README's tiny path: `tokenizer/` (the toy BPE, 512 tokens), `corpus.jsonl`
    (`documents` synthetic documents, ~120K tokens at 300) and `chats.jsonl` (`chats` conversations)."""
    out = Path(out_dir)
    return {"tokenizer": build_toy_tokenizer(out / "tokenizer"),
            "corpus": write_jsonl(out / "corpus.jsonl", synthetic_corpus(documents, seed=seed)),
            "chats": write_jsonl(out / "chats.jsonl", synthetic_chats(chats, seed=seed))}
