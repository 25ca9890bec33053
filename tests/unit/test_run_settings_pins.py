"""megatron_ext.evaluate.run_settings on what the resume tests do not try (mutation audit round 7): results of an
older version without a haystack hash are resumed, not refused; a tokenizer made in memory records no name; the
tokenizer refusal gives each side its own digest."""

import pytest

from megatron_ext.evaluate import EvalError
from megatron_ext.evaluate.run_settings import (engine_settings, refuse_other_numerics, refuse_other_prompts,
                                                tokenizer_settings)
from tests.unit.test_evaluate import make_tokenizer


def test_a_haystack_hash_is_compared_only_where_the_earlier_results_have_one():
    now = {"haystack": "book.txt", "haystack_sha256": "ab" * 32}
    refuse_other_prompts({"haystack": "book.txt"}, now, ("haystack",))  # older results: no hash recorded
    with pytest.raises(EvalError, match="^the earlier results were made with haystack_sha256 = 'cd"):
        refuse_other_prompts({"haystack": "book.txt", "haystack_sha256": "cd" * 32}, now, ("haystack",))


def test_a_tokenizer_without_a_name_records_none():
    tok = make_tokenizer()  # built in memory: name_or_path is ''
    assert tok.name_or_path == ""
    settings = tokenizer_settings(tok)
    assert settings["tokenizer"] is None and len(settings["tokenizer_sha256"]) == 64


def test_the_tokenizer_refusal_says_old_then_new():
    old = {"tokenizer": "a", "tokenizer_sha256": "1" * 64}
    with pytest.raises(EvalError) as e:
        refuse_other_numerics(old, {"tokenizer": "b", "tokenizer_sha256": "2" * 64})
    assert str(e.value) == ("--resume: the earlier cells were tokenized by another tokenizer, a (sha256 111111111111) "
                            "-> b (sha256 222222222222): resume with --tokenizer a, or use another --out")


# mutation audit round 9: what results.json records of the engine, and which earlier cells --resume keeps


def test_an_hf_model_records_torch_s_device_and_dtype_names():
    """settings.device and .dtype of an HF run are torch's names ('cpu', 'float32'), not 'torch.float32'; the
    Megatron engine's numerics are taken as given."""
    import torch

    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert engine_settings(model, None) == {"engine": "hf", "device": "cpu", "dtype": "bfloat16"}
    assert engine_settings(None, {"engine": "megatron", "dtype": "bf16"}) == {"engine": "megatron", "dtype": "bf16"}
    assert engine_settings(None, None) == {}


@pytest.mark.parametrize("old, new", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"), ("fp32", "fp32")])
def test_one_dtype_under_torch_s_name_and_the_flag_s_is_resumed(old, new):
    """HF runs recorded torch's dtype names, the Megatron engine the --dtype spelling: the same dtype either way."""
    refuse_other_numerics({"engine": "hf", "dtype": old}, {"engine": "hf", "dtype": new})


def test_another_dtype_or_engine_is_refused_naming_the_flag_to_resume_with():
    with pytest.raises(EvalError) as e:
        refuse_other_numerics({"engine": "hf", "dtype": "bfloat16"}, {"engine": "hf", "dtype": "fp32"})
    assert str(e.value) == ("--resume: the earlier cells ran with dtype bf16, this run with fp32 (bf16 -> fp32): "
                            "resume with --dtype bf16, or use another --out")
    with pytest.raises(EvalError, match="^--resume: the earlier cells ran with engine hf, this run with megatron "
                                        r"\(hf -> megatron\): resume with --engine hf,"):
        refuse_other_numerics({"engine": "hf", "dtype": "fp32"}, {"engine": "megatron", "dtype": "fp32"})


def test_a_setting_one_side_does_not_record_is_not_compared():
    """Results of older versions (no engine, dtype or tokenizer digest), or a tokenizer without a fast backend
    (no digest): resumed."""
    tok = make_tokenizer()
    refuse_other_numerics({}, {"engine": "hf", "dtype": "fp32", **tokenizer_settings(tok)})
    refuse_other_numerics({"engine": "megatron", "dtype": "bf16", **tokenizer_settings(tok)}, {})

    class Slow:  # transformers' Python tokenizers: no backend_tokenizer
        name_or_path = "slow"

    slow = tokenizer_settings(Slow())
    assert slow == {"tokenizer": "slow", "tokenizer_sha256": None}
    refuse_other_numerics(slow, tokenizer_settings(tok))


def test_the_chat_template_is_part_of_the_tokenizer_digest(tmp_path):
    """--chat prompts are the template's: a tokenizer with another template is another tokenizer; the same one
    saved and loaded back from another folder is the same."""
    from transformers import AutoTokenizer

    tok = make_tokenizer()
    tok.save_pretrained(tmp_path / "a")
    again = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer_settings(again)["tokenizer_sha256"] == tokenizer_settings(tok)["tokenizer_sha256"]
    again.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(EvalError, match="^--resume: the earlier cells were tokenized by another tokenizer"):
        refuse_other_numerics(tokenizer_settings(tok), tokenizer_settings(again))
