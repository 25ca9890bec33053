"""Pins of data/chat.py's --chat-template checks (mutation audit round 8): each test fails on one hand-made
mutant of `resolve_chat_template` / `_check_template` that the older tests let through."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.data import DataError
from megatron_ext.data.chat import LLAMA31_MARKERS, assistant_char_spans, resolve_chat_template


def _word_tokenizer(specials: list[str]):
    """A tiny real Hugging Face fast tokenizer (word level, whitespace split) with `specials` as its only added
    special tokens: every other marker encodes to several [UNK] tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1, "hello": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_llama31_names_the_one_missing_marker_in_the_singular():
    """A tokenizer with Llama-3's header tokens but no <|eot_id|>: the message names exactly that marker as
    'token', not 'tokens' (CH2: the plural for one missing marker)."""
    tok = _word_tokenizer(["<|start_header_id|>", "<|end_header_id|>"])
    with pytest.raises(DataError) as e:
        resolve_chat_template("llama3.1", tok, "my-tok")
    assert str(e.value) == ("--chat-template llama3.1: tokenizer my-tok has no <|eot_id|> token (the template's "
                            "markers would be split into ordinary text tokens); use the Llama-3.1 tokenizer, or "
                            "--chat-template tokenizer / FILE.jinja")


def test_llama31_refuses_markers_that_encode_to_no_token():
    """A BPE without an unknown token drops characters it lacks: each marker encodes to no token at all, which is
    no more a single control token than ten text tokens are (CH1: only markers of more than one token refused)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={"x": 0, "y": 1}, merges=[])))
    assert all(tok.encode(m, add_special_tokens=False) == [] for m in LLAMA31_MARKERS)
    with pytest.raises(DataError, match=r"has no <\|start_header_id\|> / <\|end_header_id\|> / <\|eot_id\|> tokens"):
        resolve_chat_template("llama3.1", tok)


def test_tokenizer_with_an_empty_chat_template_is_said_to_have_none():
    """`--chat-template tokenizer` with a tokenizer whose chat_template is "" (as an empty field in
    tokenizer_config.json reads): the fix-giving 'has no chat_template' error, not an empty template accepted
    (CH4: only None counted as no template)."""
    tok = _word_tokenizer([])
    tok.chat_template = ""
    with pytest.raises(DataError) as e:
        resolve_chat_template("tokenizer", tok)
    assert str(e.value) == ("--chat-template tokenizer: the tokenizer has no chat_template; use --chat-template "
                            "llama3.1 or a Jinja file")


def test_a_folder_is_not_a_template_file(tmp_path: Path):
    """A folder given as --chat-template is one line naming it, not an IsADirectoryError traceback (CH5: exists()
    for is_file())."""
    with pytest.raises(DataError) as e:
        resolve_chat_template(str(tmp_path), _word_tokenizer([]))
    assert str(e.value) == f"--chat-template {tmp_path}: not 'llama3.1', 'tokenizer' or an existing Jinja file"


def test_a_template_file_that_is_not_utf8_is_refused(tmp_path: Path):
    """A Latin-1 template file (é as one byte 0xE9) is refused as not UTF-8, not read as some other encoding that
    would render other bytes than the author wrote (CH6: read as latin-1)."""
    template = tmp_path / "latin1.jinja"
    template.write_bytes("{% for m in messages %}{{ m['content'] }} é{% endfor %}".encode("latin-1"))
    with pytest.raises(DataError) as e:
        resolve_chat_template(str(template), _word_tokenizer([]))
    assert str(e.value) == f"--chat-template {template}: not a UTF-8 text file; pass a Jinja chat template"


def test_a_template_that_writes_only_the_generation_prompt_is_empty(tmp_path: Path):
    """A template whose only output is the generation prompt renders every stored conversation (rendered without
    that prompt) as nothing: refused at the trial render (CH9: the trial rendered with add_generation_prompt)."""
    template = tmp_path / "prompt_only.jinja"
    template.write_text("{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
    with pytest.raises(DataError, match="the template renders a conversation as empty text"):
        resolve_chat_template(str(template), _word_tokenizer([]))


def test_a_template_that_writes_only_whitespace_is_empty(tmp_path: Path):
    """A template that writes a newline per message (as an expression: transformers trims a newline after a tag)
    and no content renders conversations as blank text: refused like an empty rendering (CH13: only a rendering of
    zero characters refused)."""
    template = tmp_path / "blank.jinja"
    template.write_text("{% for m in messages %}{{ '\\n' }}{% endfor %}")
    with pytest.raises(DataError, match="the template renders a conversation as empty text"):
        resolve_chat_template(str(template), _word_tokenizer([]))


def test_generation_prompt_unlike_the_rendered_turn_is_not_prefix_stable():
    """A template whose generation prompt ('ASSISTANT: ') is not how it renders the stored reply ('Assistant: ')
    has no well-defined assistant span: DataError, not a mask shifted by the prompt's length (CH14: only the
    prefix check of the whole conversation kept)."""
    template = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match="chat template is not prefix-stable"):
        assistant_char_spans(_word_tokenizer([]), messages, template)


def test_a_reply_rendered_differently_when_last_is_not_prefix_stable():
    """A template that marks the final reply ('!') renders the first reply one way inside the conversation and
    another way as the last message of a prefix: DataError, not a span measured on text the sample does not hold
    (CH15: only the prompt-is-a-prefix-of-the-turn check kept)."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if loop.last and m['role'] == 'assistant' %}!{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match="chat template is not prefix-stable"):
        assistant_char_spans(_word_tokenizer([]), messages, template)


def test_tokenizer_spec_uses_the_tokenizers_own_template():
    """`--chat-template tokenizer` renders with the tokenizer's chat_template, whatever it is, not the built-in
    Llama-3.1 one (CH24: the toy tokenizer's template is the built-in one, so older tests could not tell)."""
    tok = _word_tokenizer([])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert resolve_chat_template("tokenizer", tok) == tok.chat_template
