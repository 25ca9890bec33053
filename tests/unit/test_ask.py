"""`tools/niah.py generate` prompts (megatron_ext.evaluate.ask) and its answer on the transformers engine; the
Megatron engine's answer is compared with it in tests/distributed/test_niah_megatron.py."""

import pytest
import torch

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.ask import document_prompt, generate_hf
from tests.unit.test_evaluate import CHAT_TEMPLATE, make_model, make_tokenizer

DOC = "The old river passes the garden.\nA farmer greets the teacher near the hill.\n"


def test_plain_and_chat_prompts():
    tok = make_tokenizer()
    plain = document_prompt(tok, DOC, "What is the special magic number?")
    assert plain[0] == tok.bos_token_id and plain.count(tok.bos_token_id) == 1
    assert tok.decode(plain[1:]) == DOC.rstrip() + "\n\nWhat is the special magic number?"
    assert tok.decode(document_prompt(tok, "", "What is the special magic number?")[1:]).startswith("What")
    tok.chat_template = CHAT_TEMPLATE
    chat = document_prompt(tok, DOC, "What is the special magic number?", chat=True)
    assert chat.count(tok.bos_token_id) == 1  # the template's own, not a second one
    assert tok.decode(chat).startswith("<s>[user]\nThe old river") and tok.decode(chat).endswith("[assistant]\n")


def test_prompt_errors():
    tok = make_tokenizer()
    with pytest.raises(EvalError, match="the prompt is empty"):
        document_prompt(tok, "  \n", None)
    with pytest.raises(EvalError, match="--chat needs a tokenizer with a chat template"):
        document_prompt(tok, DOC, None, chat=True)


def test_generate_hf_is_greedy_and_checks_the_length():
    from megatron_ext.evaluate.generate import eos_ids, greedy_generate

    model, tok = make_model(), make_tokenizer()
    got = generate_hf(model, tok, DOC * 3, "What is the special magic number?", max_new_tokens=5)
    ids = torch.tensor([document_prompt(tok, DOC * 3, "What is the special magic number?")])
    want = greedy_generate(model, ids, 5, eos_token_ids=eos_ids(model, tok))[0]
    assert got.output_ids == want and got.output == tok.decode(want, skip_special_tokens=True)
    assert got.settings["engine"] == "hf" and got.prompt_tokens > 30
    with pytest.raises(EvalError, match=r"more than the model's max_position_embeddings = 256: shorten --document"):
        generate_hf(model, tok, DOC * 40, None, max_new_tokens=1)
    assert generate_hf(model, tok, DOC * 40, None, max_new_tokens=1, force=True).prompt_tokens > 256


def test_prompt_edges_and_the_length_limit():
    """Mutation audit round 7: a question of blanks alone is an empty prompt; no question adds no blank line; a
    prompt of exactly max_position_embeddings tokens fits (positions 0 .. max-1), one more does not."""
    from megatron_ext.evaluate.ask import _check_length

    tok = make_tokenizer()
    with pytest.raises(EvalError, match="the prompt is empty"):
        document_prompt(tok, "", "  ")
    assert tok.decode(document_prompt(tok, DOC, None)[1:]) == DOC.rstrip()
    _check_length(256, 256, False)
    _check_length(257, None, False)  # no limit known
    with pytest.raises(EvalError, match="has 257 tokens"):
        _check_length(257, 256, False)


def test_generate_hf_records_chat_and_stops_at_the_models_eos():
    """The model's second greedy token made its end-of-sequence token: the answer stops there (mutation audit
    round 7: eos ignored, settings.chat always False)."""
    model, tok = make_model(), make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    free = generate_hf(model, tok, DOC, "Why?", chat=True, max_new_tokens=4)
    assert free.settings["chat"] is True and len(free.output_ids) == 4  # the control: no eos among them
    eos = free.output_ids[1]
    model.generation_config.eos_token_id = eos
    stopped = generate_hf(model, tok, DOC, "Why?", chat=True, max_new_tokens=4)
    assert stopped.output_ids == free.output_ids[:free.output_ids.index(eos) + 1]


def test_a_tokenizer_that_adds_bos_itself_still_gives_one():
    """Llama's tokenizers add BOS by themselves (a post-processor); the chat template writes its own: one BOS in
    either prompt (mutation audit round 7: the template's text tokenized with the special tokens had two)."""
    from tokenizers.processors import TemplateProcessing

    tok = make_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("river")["input_ids"][0] == tok.bos_token_id  # the control: it adds BOS
    tok.chat_template = CHAT_TEMPLATE
    for chat in (False, True):
        assert document_prompt(tok, DOC, "Why?", chat=chat).count(tok.bos_token_id) == 1
