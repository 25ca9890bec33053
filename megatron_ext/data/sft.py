"""SFT chat data preparation and packing.

Storage layout (one sample = one document in both datasets, same order, same lengths):
- `PREFIX.bin/.idx`: token ids of each rendered conversation (Megatron-Core indexed dataset);
- `PREFIX_lossmask.bin/.idx`: uint8 per token, 1 on assistant tokens (content + end-of-turn);
- `PREFIX.json`: manifest (kind "sft", seq_length, counts of kept/dropped samples, packing stats).

Packing into `seq_length`-token sequences happens when reading (`pack_samples`, deterministic in
the seed), so one prepared file serves any sequence length up to the one it was filtered for.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from megatron_ext.data.chat import LLAMA31_ROLES, resolve_chat_template, tokenize_chat
from megatron_ext.data.common import (FORMAT_VERSION, DataError, atomic_outputs, check_outputs, length_histogram,
                                      load_tokenizer, token_dtype, tokenizer_hash,
                                      tokenizer_vocabulary_hash, write_json)
from megatron_ext.data.sources import ReadStats, check_inputs, get_field, iter_rows
from megatron_ext.progress import progress_bar


def pack_samples(lengths: np.ndarray, seq_length: int, seed: int = 0) -> list[list[int]]:
    """Group sample indices into packs of total length <= seq_length; never split a sample.

    Best-fit decreasing (each sample, longest first, goes into the fullest pack it still fits),
    then packs are shuffled with `seed` and each pack keeps its samples in index order.
    Deterministic: same lengths and seed give the same packs. Samples longer than seq_length
    raise ValueError (preparation drops them first).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > seq_length:
        raise ValueError(f"sample of {int(lengths.max())} tokens exceeds seq_length {seq_length}")
    order = np.argsort(-lengths, kind="stable")
    packs: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, pack id)
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            cap, pid = free.pop(k)
        else:
            cap, pid = seq_length, len(packs)
            packs.append([])
        packs[pid].append(i)
        bisect.insort(free, (cap - n, pid))
    rng = np.random.default_rng(seed)
    return [sorted(packs[p]) for p in rng.permutation(len(packs)).tolist()]


def prepare_sft(inputs: list[str], tokenizer: str, output: str, seq_length: int, *,
                messages_field: str | None = None, answer_field: str | None = None, max_samples: int | None = None,
                chat_template: str = "llama3.1", seed: int = 1234, force: bool = False, progress: bool = True) -> dict:
    """Render chats, mask non-assistant tokens, drop samples > seq_length; write PREFIX(+_lossmask).

    Returns the manifest. Samples with no assistant turn or longer than `seq_length` are dropped
    and counted, as are malformed ones ("bad_messages"): not a list of {role, content} strings, or, with the
    built-in llama3.1 template, a role Llama-3.1 does not know (`usr`, `human`). A custom template decides
    itself what a role means: such roles are kept then, with a warning. `messages_field` None: `messages`, or
    `conversations` in rows without it (ShareGPT's field); turns in ShareGPT's form ({"from": "human"|"gpt"|...,
    "value": ...}) are read as {role, content} (`SHAREGPT_ROLES`). `answer_field` names a row's final
    reply kept apart from its messages (AceMath-Instruct, the paper's SFT source: `messages` + `answer`): it
    becomes the conversation's last assistant turn. `max_samples` keeps that many rows, drawn uniformly with
    `seed` (the paper subsamples ~100K), before the drops above. Raises DataError on user mistakes; nothing is
    left at `output` then.
    """
    if seq_length <= 0:
        raise DataError(f"--seq-length {seq_length}: must be positive")
    if max_samples is not None and max_samples <= 0:
        raise DataError(f"--max-samples {max_samples}: must be a positive number of rows (leave it out for all)")
    check_inputs(inputs)
    check_outputs(output, force, with_lossmask=True, inputs=inputs)
    tok = load_tokenizer(tokenizer, announce="sft" if progress else None)
    template = resolve_chat_template(chat_template, tok, tokenizer)
    vocab_size = len(tok)
    dtype = token_dtype(vocab_size)
    stats = ReadStats()
    dropped = {"no_assistant_turn": 0, "too_long": 0, "bad_messages": 0}
    too_long_range = (sys.maxsize, 0)  # shortest and longest sample dropped as too long, for the fix
    ends_with_prompt = 0  # kept samples whose last turn is a prompt: its reply is missing (in another field?)
    reply_fields: Counter[str] = Counter()  # rows' top-level string fields that look like that reply
    odd_roles: Counter[str] = Counter()  # roles outside LLAMA31_ROLES, for the end report
    lengths: list[int] = []
    n_read = n_tokens = n_trained = n_sharegpt = 0
    fields_read: Counter[str] = Counter()  # rows per messages field read (messages / conversations / the given one)
    max_id = -1  # recorded so that the trainer can refuse a model whose embedding has no row for some id
    t0 = time.perf_counter()
    import jinja2
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # after the cheap checks

    with atomic_outputs(output, with_lossmask=True) as tmp:
        tokens_b = IndexedDatasetBuilder(tmp[output + ".bin"], dtype=dtype)
        mask_b = IndexedDatasetBuilder(tmp[output + "_lossmask.bin"], dtype=np.uint8)
        rows = iter_rows(inputs, stats)
        total = rows_in_input = None
        if max_samples is not None:
            rows, rows_in_input = _sample_rows(rows, max_samples, seed, progress)
            total = len(rows)
        bar = progress_bar(desc="sft", unit="sample", total=total, enabled=progress)
        for _name, where, row in rows:
            n_read += 1
            bar.update(1)
            turns = _row_turns(row, where, messages_field, answer_field)
            messages = turns.messages
            fields_read[turns.field] += 1
            n_sharegpt += turns.sharegpt
            problem = turns.problem or _messages_problem(messages, turns.field, chat_template)
            role = None if problem else next((m["role"] for m in messages if m["role"] not in LLAMA31_ROLES), None)
            if role is not None:
                odd_roles[role] += 1
                if chat_template == "llama3.1":
                    problem = f"role '{role}' is not one of {', '.join(LLAMA31_ROLES)}"
                elif odd_roles[role] == 1:
                    print(f"warning: {where}: role '{role}' is not one of Llama-3.1's ({', '.join(LLAMA31_ROLES)}); "
                          f"kept, as --chat-template {chat_template} renders it (a typo? fix the data)",
                          file=sys.stderr)
            if problem:
                if not dropped["bad_messages"]:
                    print(f"warning: {where}: sample skipped: {problem} (further ones are counted and reported "
                          "at the end)", file=sys.stderr)
                dropped["bad_messages"] += 1
                continue
            # the last reply elsewhere, or missing: after a prompt, or after a tool's result (the reply that uses it)
            unanswered = bool(messages) and messages[-1]["role"] in PROMPT_ROLES
            if unanswered:
                reply_fields.update(k for k in REPLY_FIELDS if isinstance(row.get(k), str))
            if not any(m["role"] == "assistant" for m in messages):
                dropped["no_assistant_turn"] += 1
                continue
            try:
                ids, mask = tokenize_chat(tok, messages, template)
            except (jinja2.TemplateError, ValueError) as e:  # raise_exception(...) in the template, an undefined name
                raise DataError(f"--chat-template {chat_template}: rendering {where} failed ({type(e).__name__}: "
                                f"{' '.join(str(e).split())}); fix the template or that sample") from None
            if not ids:
                raise DataError(f"--chat-template {chat_template}: renders {where} as no tokens; the template "
                                "must output the conversation's messages")
            if len(ids) > seq_length:
                dropped["too_long"] += 1
                too_long_range = (min(too_long_range[0], len(ids)), max(too_long_range[1], len(ids)))
                continue
            ends_with_prompt += unanswered
            tokens_b.add_document(np.array(ids, dtype=dtype), [len(ids)])
            max_id = max(max_id, max(ids))
            mask_b.add_document(np.array(mask, dtype=np.uint8), [len(mask)])
            lengths.append(len(ids))
            n_tokens += len(ids)
            n_trained += sum(mask)
        bar.close()
        tokens_b.finalize(tmp[output + ".idx"])
        mask_b.finalize(tmp[output + "_lossmask.idx"])
        if not lengths:
            raise DataError(f"--input {' '.join(inputs)}: no usable SFT samples ({n_read} read; dropped: "
                            f"{dropped}{_roles_note(odd_roles)}; lines skipped: {stats.summary()})"
                            f"{_too_long_hint(dropped, too_long_range, seq_length)}"
                            f"{_reply_hint(reply_fields, answer_field)}")
        packs = pack_samples(np.array(lengths), seq_length, seed)
        manifest = {
            "format_version": FORMAT_VERSION, "kind": "sft", "samples": len(lengths), "samples_read": n_read,
            "documents": len(lengths), "tokens": n_tokens, "trained_tokens": n_trained, "dropped": dropped,
            "ends_with_prompt": ends_with_prompt, "sharegpt_rows": n_sharegpt, "seq_length": seq_length,
            "packs": len(packs),
            "pack_fill": round(n_tokens / (len(packs) * seq_length), 6),
            "length_histogram": length_histogram(np.array(lengths)),
            "skipped": {"non_utf8_lines": stats.non_utf8, "bad_json_lines": stats.bad_json,
                        "not_object_lines": stats.not_object},
            "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "tokenizer": tokenizer,
            "max_token_id": max(max_id, _pad_id(tok)),  # the loader pads samples with pad_id
            "tokenizer_hash": tokenizer_hash(tok), "vocabulary_hash": tokenizer_vocabulary_hash(tok),
            "pad_id": _pad_id(tok), "loss_mask_prefix_suffix": "_lossmask",
            "messages_fields_read": dict(fields_read), "rows_in_input": rows_in_input,
            "settings": {"inputs": list(inputs), "messages_field": messages_field, "answer_field": answer_field,
                         "max_samples": max_samples, "chat_template": chat_template, "seed": seed},
        }
        write_json(tmp[output + ".json"], manifest)
    stats.report()
    dropped_total = sum(dropped.values())
    if dropped_total:
        print(f"warning: dropped {dropped_total} samples: {dropped}{_roles_note(odd_roles)}", file=sys.stderr)
    elif odd_roles:
        print(f"warning: kept samples with roles Llama-3.1 does not know{_roles_note(odd_roles)}", file=sys.stderr)
    if ends_with_prompt:
        print(f"warning: {ends_with_prompt} kept samples end with a user or tool turn: their last prompt has no "
              f"reply to learn{_reply_hint(reply_fields, answer_field)}", file=sys.stderr)
    if progress:
        print(f"wrote {output}(.bin/.idx, _lossmask.bin/.idx, .json): {len(lengths)} samples from "
              f"{stats.inputs_read()}, {n_tokens} tokens, {len(packs)} packs of {seq_length} in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return manifest


def _messages_problem(messages: Any, field: str, chat_template: str) -> str | None:
    """Why `messages` is not a conversation to train on (None when it is): not a list of {"role": str,
    "content": str} dicts; an assistant turn first (the template has nothing before it to render) or empty (the
    model would learn to answer nothing); tool calls the built-in template does not render (an empty reply)."""
    if not isinstance(messages, list):
        return f"'{field}' is a {type(messages).__name__}, not a list of messages"
    for j, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"message {j} of '{field}' is not an object with string 'role' and 'content'"
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): the tokenizer would refuse it
            return f"message {j} holds a lone surrogate, no UTF-8 text"
        if m["role"] != "assistant":
            continue
        if j == 1:
            return "it starts with an assistant turn (no prompt before it)"
        if "tool_calls" in m and chat_template == "llama3.1":
            return (f"message {j} has tool_calls, which --chat-template llama3.1 does not render (the model would "
                    "learn an empty reply); use --chat-template tokenizer with Meta's template, or drop them")
        if not m["content"].strip() and "tool_calls" not in m:
            return f"message {j} is an empty assistant turn (the model would learn to answer nothing)"
    return None


# ShareGPT's speaker names ({"from": ..., "value": ...} turns: ShareGPT, SlimOrca, many SFT sets) -> chat roles;
# other names are kept as they are, and the role check below names them.
PROMPT_ROLES = ("user", "tool", "ipython")  # a turn that asks for a reply


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool", "function_response": "tool",
                  "observation": "tool"}


def _from_sharegpt(messages: Any) -> list[dict] | None:
    """`messages` as {role, content} turns when all are ShareGPT's {from, value} turns; else None (left as given)."""
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("from"), str) and "value" in m and "role" not in m
                    for m in messages)):
        return None
    return [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in messages]


@dataclass
class _Turns:
    """A row's conversation as read: its turns, the field they came from, whether they were in ShareGPT's form, and
    why the row cannot be trained on as it is (None: it can, so far)."""

    messages: Any
    field: str
    sharegpt: bool = False
    problem: str | None = None


def _row_turns(row: dict, where: str, messages_field: str | None, answer_field: str | None) -> _Turns:
    """The turns of `row`: from `messages_field` (None: `messages`, or ShareGPT's `conversations`), read from
    ShareGPT's form, with `answer_field`'s reply appended as the last assistant turn where the turns end with a
    prompt. DataError when a named field is missing."""
    field = messages_field or ("conversations" if "messages" not in row and "conversations" in row else "messages")
    try:
        messages = get_field(row, field)
    except KeyError:
        also = "" if messages_field else " or 'conversations'"
        raise DataError(f"{where}: no field '{field}'{also} (fields: {', '.join(sorted(row))}); "
                        "pass --messages-field NAME") from None
    sharegpt = _from_sharegpt(messages)
    turns = _Turns(messages if sharegpt is None else sharegpt, field, sharegpt is not None)
    if answer_field is None:
        return turns
    try:
        answer = get_field(row, answer_field)
    except KeyError:
        raise DataError(f"{where}: no field '{answer_field}' (fields: {', '.join(sorted(row))}); pass --answer-field "
                        "NAME, or leave it out when the replies are in the messages") from None
    if not isinstance(answer, str):
        turns.problem = f"'{answer_field}' is a {type(answer).__name__}, not a string"
    elif isinstance(turns.messages, list) and turns.messages and isinstance(turns.messages[-1], dict):
        if turns.messages[-1].get("role") == "assistant":  # a reply already there (a solution, the answer beside it)
            turns.problem = (f"its turns end with an assistant reply and '{answer_field}' holds another: two replies "
                             "in a row (leave --answer-field out for such data)")
        else:
            turns.messages = [*turns.messages, {"role": "assistant", "content": answer}]
    return turns


# Top-level row fields that datasets use for the reply to the last message (AceMath-Instruct: `answer`).
REPLY_FIELDS = ("answer", "response", "output", "completion")


def _reply_hint(reply_fields: Counter[str], answer_field: str | None) -> str:
    """'; the rows have a string field 'answer': pass --answer-field answer ...' when conversations ended with
    a prompt and their rows hold a reply-like field not already used; else ''."""
    found = [f for f, _ in reply_fields.most_common() if f != answer_field]
    if not found:
        return ""
    return (f"; these rows have a string field '{found[0]}': if it holds the reply, pass --answer-field {found[0]} "
            "(it becomes the last assistant turn)")


def _too_long_hint(dropped: dict[str, int], too_long_range: tuple[int, int], seq_length: int) -> str:
    """'; 200 were too long (117 to 354 tokens, beyond --seq-length 16): raise --seq-length ...' when the drops
    for length are the most frequent kind; else ''."""
    n = dropped["too_long"]
    if not n or n < max(dropped.values()):
        return ""
    shortest, longest = too_long_range
    lengths = f"{shortest} to {longest}" if shortest < longest else f"{longest}"
    return (f"; {n} {'were' if n > 1 else 'was'} too long ({lengths} tokens, beyond "
            f"--seq-length {seq_length}): raise --seq-length, to {longest} to keep every one")


def _sample_rows(rows: Iterator[tuple[str, str, dict]], k: int, seed: int,
                 progress: bool) -> tuple[list[tuple[str, str, dict]], int]:
    """`k` of `rows` drawn uniformly without replacement (reservoir sampling, deterministic in `seed`), in their
    input order, and the number of rows read. Holds the k rows in memory: ~100K chat rows are a few hundred MB."""
    rng = np.random.default_rng([seed, 0x5eed])  # a stream apart from the packing's default_rng(seed)
    kept: list[tuple[int, tuple[str, str, dict]]] = []
    for i, item in enumerate(progress_bar(rows, desc="sft: drawing rows", unit="row", enabled=progress)):
        if i < k:
            kept.append((i, item))
        else:
            j = int(rng.integers(0, i + 1))
            if j < k:
                kept[j] = (i, item)
    kept.sort(key=lambda t: t[0])
    n_rows = i + 1 if kept else 0
    if progress:
        print(f"sft: drew {len(kept)} of {n_rows} rows (--max-samples {k}, --seed {seed})", file=sys.stderr)
    return [item for _, item in kept], n_rows  # a list: its length is the total of the progress bar that follows


def _roles_note(odd_roles: Counter[str]) -> str:
    """'; unknown roles: usr (3), wizard (1)' (the five most frequent), or '' when there were none."""
    if not odd_roles:
        return ""
    more = f", +{len(odd_roles) - 5} more" if len(odd_roles) > 5 else ""
    return "; unknown roles: " + ", ".join(f"{r} ({n})" for r, n in odd_roles.most_common(5)) + more


def _pad_id(tok: Any) -> int:
    """Padding id for packed sequences: the tokenizer's pad token, else EOS, else 0 (always masked)."""
    for t in (tok.pad_token_id, tok.eos_token_id):
        if t is not None:
            return int(t)
    return 0
