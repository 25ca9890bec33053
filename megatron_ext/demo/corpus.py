"""Synthetic long-context corpus and tokenizer for the CPU demo (no downloads).

Documents teach retrieval in the exact form the NIAH evaluation asks for: the instruction, filler
text with one needle sentence holding a random 7-digit value, the question, and the answer
(`megatron_ext.evaluate.NeedleTask`'s texts, verbatim). Some documents also carry key-value facts
("The code of the blue falcon is 4821.") recalled later inside the filler, so the model must match
keys, not just copy the only number in sight. Filler is the evaluation's own built-in sentence
generator (different seeds), so training and evaluation haystacks share a distribution but not
their text.

The tokenizer is a byte-level BPE trained on this corpus with each digit its own token (so a
7-digit value is 7 tokens and copying it is a pure induction task), with Llama-3's special tokens
and chat template: `AutoTokenizer.from_pretrained(dir)` loads it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from megatron_ext.evaluate.haystack import filler_sentences
from megatron_ext.evaluate.niah import NeedleTask

_KEY_ADJ = ["blue", "red", "golden", "silver", "hidden", "northern", "crimson", "iron"]
_KEY_NOUN = ["falcon", "lantern", "engine", "tower", "violin", "compass", "beacon", "mirror"]
TASK = NeedleTask()


def _value(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def needle_document(rng: random.Random, n_sentences: int, kv_facts: int = 0, answer: bool = True) -> str:
    """One NIAH-shaped document: instruction, `n_sentences` filler sentences with the needle at a
    random sentence boundary (and `kv_facts` key-value facts recalled later in the filler), then
    the question and (when `answer`) the answer sentence."""
    filler = filler_sentences(rng.randrange(1 << 30))
    sents = [next(filler) for _ in range(n_sentences)]
    for _ in range(kv_facts):  # a fact early, its recall later, both between filler sentences
        key = f"{rng.choice(_KEY_ADJ)} {rng.choice(_KEY_NOUN)}"
        code = _value(rng, 4)
        i = rng.randrange(len(sents) + 1)
        j = rng.randrange(i, len(sents) + 1)
        sents.insert(j, f"Question: what is the code of the {key}? Answer: {code}.")
        sents.insert(i, f"The code of the {key} is {code}.")
    value = _value(rng, TASK.value_digits)
    at = rng.randrange(len(sents) + 1)
    hay = " ".join(sents[:at]) + TASK.needle.format(value=value) + (" " + " ".join(sents[at:]) if sents[at:] else "")
    text = TASK.instruction + " " + hay.lstrip(" ")  # as the evaluation's haystack, which starts with a space
    text += TASK.question + TASK.answer_prefix
    return text + f" {value}." if answer else text


def demo_corpus(n_docs: int, seed: int, min_sentences: int, max_sentences: int,
                kv_every: int = 2, length_power: float = 1.0) -> Iterator[dict]:
    """`n_docs` documents `{"id", "source", "text"}`; every `kv_every`-th also has 1-3 key-value facts.

    Filler sentences per document: min + (max - min) * u ** `length_power`, u uniform in [0, 1)
    (power > 1: mostly short documents, i.e. many retrievals per token, some long ones).
    """
    rng = random.Random(seed)
    for i in range(n_docs):
        kv = rng.randint(1, 3) if kv_every and i % kv_every == 0 else 0
        n = min_sentences + int((max_sentences - min_sentences + 1) * rng.random() ** length_power)
        text = needle_document(rng, n, kv_facts=kv)
        yield {"id": i, "source": "needle-kv" if kv else "needle", "text": text}


def demo_chats(n: int, seed: int, min_sentences: int, max_sentences: int) -> Iterator[dict]:
    """SFT chats: the user message is a NIAH document without its answer; the assistant answers in full."""
    rng = random.Random(seed)
    for _ in range(n):
        doc = needle_document(rng, rng.randint(min_sentences, max_sentences), answer=True)
        prompt, _, value = doc[: -1].rpartition(TASK.answer_prefix + " ")
        yield {"messages": [{"role": "user", "content": prompt},
                            {"role": "assistant", "content": f"{TASK.answer_prefix.strip()} {value}."}]}


def build_demo_tokenizer(out_dir: str | Path, vocab_size: int = 768, seed: int = 0) -> Path:
    """Train the demo's byte-level BPE (digits split one per token) and save it as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.data.chat import LLAMA31_CHAT_TEMPLATE
    from megatron_ext.data.toy import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [d["text"] for d in demo_corpus(300, seed=seed, min_sentences=5, max_sentences=40)]
    texts += ["<s>", "Question: Answer:"]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>")
    fast.chat_template = LLAMA31_CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out
