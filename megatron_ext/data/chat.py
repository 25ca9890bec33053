"""Chat rendering for SFT: a Llama-3.1 chat template and assistant-only loss masks.

The mask is found from the *rendered text*, so any chat template works (no `{% generation %}`
tags needed): assistant turn j's trained span is the text between
`render(messages[:j], add_generation_prompt=True)` and `render(messages[:j+1])`, i.e. the
assistant content plus its end-of-turn token (`<|eot_id|>` for Llama-3.1), never the role header.
Tokens whose first character lies inside such a span get loss mask 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.data.common import DataError

# The roles Llama-3.1-Instruct's own template knows: `tool` results are rendered under the `ipython` header
# (as Meta's template does). The built-in template would write any other role verbatim as a header the model
# never saw, so `prepare_sft` drops samples with other roles when it renders with the built-in template.
LLAMA31_ROLES = ("system", "user", "assistant", "tool", "ipython")

# Llama-3.1-Instruct's conversation format without tool calls (written for this project): a system
# block with the knowledge-date header always present, then `<|start_header_id|>ROLE<|end_header_id|>\n\n
# CONTENT<|eot_id|>` per turn (ROLE `ipython` for a `tool` message, whose content Meta's template writes as
# JSON: a string in quotes, untrimmed; transformers' `tojson` keeps non-ASCII as is). Assistant content sits in
# `{% generation %}` so transformers' `return_assistant_tokens_mask=True` can serve as an independent oracle
# for our masks.
LLAMA31_CHAT_TEMPLATE = (
    r"{{- bos_token }}"
    r"{%- if messages and messages[0]['role'] == 'system' %}"
    r"{%- set system_message = messages[0]['content'] | trim %}{%- set loop_messages = messages[1:] %}"
    r"{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    r"{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    r"{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    r"{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}"
    r"{{- system_message + '<|eot_id|>' }}"
    r"{%- for message in loop_messages %}"
    r"{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    r"{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    r"{%- if message['role'] == 'assistant' %}"
    r"{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    r"{%- elif role == 'ipython' %}{{- message['content'] | tojson + '<|eot_id|>' }}"
    r"{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


# The control tokens the built-in template writes: each must be one token of the tokenizer, or the rendered
# markers become ~10 ordinary text tokens each and the model never sees (nor learns to emit) an end of turn.
LLAMA31_MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def resolve_chat_template(spec: str, tokenizer: Any, tokenizer_name: str = "") -> str:
    """`llama3.1` -> the built-in template; `tokenizer` -> the tokenizer's own; else a Jinja file path.

    DataError (naming --chat-template and the file) for an empty file, a Jinja syntax error or a template
    that renders a conversation as nothing; for `llama3.1`, when the tokenizer (`tokenizer_name`, for the
    message) lacks Llama-3's header and end-of-turn tokens.
    """
    if spec == "llama3.1":
        missing = [m for m in LLAMA31_MARKERS if len(tokenizer.encode(m, add_special_tokens=False)) != 1]
        if missing:
            raise DataError(f"--chat-template llama3.1: tokenizer {tokenizer_name or 'given'} has no "
                            f"{' / '.join(missing)} token{'s' if len(missing) > 1 else ''} (the template's "
                            "markers would be split into ordinary text tokens); use the Llama-3.1 tokenizer, or "
                            "--chat-template tokenizer / FILE.jinja")
        return LLAMA31_CHAT_TEMPLATE
    if spec == "tokenizer":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("--chat-template tokenizer: the tokenizer has no chat_template; "
                            "use --chat-template llama3.1 or a Jinja file")
        template = tokenizer.chat_template
    else:
        path = Path(spec)
        if not path.is_file():
            raise DataError(f"--chat-template {spec}: not 'llama3.1', 'tokenizer' or an existing Jinja file")
        try:
            template = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"--chat-template {spec}: not a UTF-8 text file; pass a Jinja chat template") from None
        if not template.strip():
            raise DataError(f"--chat-template {spec}: empty template; write a Jinja chat template into it "
                            "(one that renders `messages`), or use --chat-template llama3.1 or tokenizer")
    _check_template(spec, tokenizer, template)
    return template


def _check_template(spec: str, tokenizer: Any, template: str) -> None:
    """Compile `template` the way transformers does (a trial render): a Jinja syntax error or a template
    that renders a conversation as nothing is a DataError; errors at render time show up per sample."""
    import jinja2

    trial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        text = _render(tokenizer, trial, template, False)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"--chat-template {spec}: Jinja syntax error at line {e.lineno}: "
                        f"{' '.join(str(e.message).split())}") from None
    except Exception:  # noqa: BLE001 - a runtime error (raise_exception, undefined) may be specific to this trial
        return
    if not text.strip():
        raise DataError(f"--chat-template {spec}: the template renders a conversation as empty text; "
                        "it must output the `messages` (use --chat-template llama3.1 for Llama-3.1's format)")


def _render(tokenizer: Any, messages: list[dict], template: str, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer: Any, messages: list[dict], template: str) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages`; return (text, [(start, end) char spans of each assistant turn]).

    Raises DataError when the template is not prefix-stable (rendering a prefix of the
    conversation is not a prefix of the full rendering), since then spans are ill-defined.
    """
    text = _render(tokenizer, messages, template, False)
    spans = []
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start_text = _render(tokenizer, messages[:j], template, True)
        end_text = _render(tokenizer, messages[: j + 1], template, False)
        if not (text.startswith(end_text) and end_text.startswith(start_text)):
            raise DataError("chat template is not prefix-stable (rendering the first turns is not a prefix "
                            "of the whole conversation); assistant spans cannot be located. Use "
                            "--chat-template llama3.1 or a template with that property")
        if len(end_text) > len(start_text):
            spans.append((len(start_text), len(end_text)))
    return text, spans


def tokenize_chat(tokenizer: Any, messages: list[dict], template: str) -> tuple[list[int], list[int]]:
    """Render and tokenize one conversation; return (token ids, loss mask) of equal length.

    mask[i] = 1 iff token i belongs to an assistant turn (content + end-of-turn token).
    """
    text, spans = assistant_char_spans(tokenizer, messages, template)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    k = 0
    for i, (s, _e) in enumerate(offsets):  # offsets and spans are both sorted: one merge pass
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1]:
            mask[i] = 1
    return ids, mask
