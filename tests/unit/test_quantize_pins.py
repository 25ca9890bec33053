"""Pins of megatron_ext.quantize.fp8 found by mutation audit round 9 (CPU, fake quantization with the real ModelOpt):
which config.json files `tools/quantize.py` refuses and how it names them, the ModelOpt config it builds (left for
the next call as it found it), the dtype --dtype loads, calibration that leaves a single quantizer without a scale,
the input scales calibration gives (torch hooks the oracle), and the export folder: refused when it exists, made
with its parents and the umask's mode, and nothing left after a Ctrl-C."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from megatron_ext.presets import TINY  # noqa: E402
from megatron_ext.quantize import QuantizeError, quant_config, quantize, read_hf_config  # noqa: E402
from megatron_ext.quantize.fp8 import load_model  # noqa: E402


def _config(tmp_path, **changes):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **changes}))
    return tmp_path


def test_config_json_that_is_a_folder_is_no_config(tmp_path):
    """A folder named config.json (or a link to one) is no config: the one line, not an IsADirectoryError (Q1)."""
    (tmp_path / "config.json").mkdir()
    with pytest.raises(QuantizeError, match="no config.json there"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("changes, says", [
    ({"architectures": []}, 'has no "architectures" field'),  # Q2: taken for an unsupported one
    ({"architectures": ["LlamaForCausalLM", "LlamaForCausalLM"]}, "is not supported"),  # Q3: one class, or none
    ({"quantization_config": {"quant_method": "fp8"}}, "already has a quantization_config (fp8): quantize the "
                                                       "original model"),  # Q4, Q5
])
def test_config_json_refusals(tmp_path, changes, says):
    with pytest.raises(QuantizeError) as refused:
        read_hf_config(_config(tmp_path, **changes))
    assert says in str(refused.value)


def test_quant_config_values_are_checked_one_by_one():
    """A bad --weights with a good --kv-cache is refused too (Q6: only both bad were)."""
    import modelopt.torch.quantization as mtq

    for weights, kv_cache in (("int8", "fp8"), ("fp8", "int8")):
        with pytest.raises(QuantizeError, match="take fp8 or none"):
            quant_config(mtq, weights, kv_cache)


def test_quant_config_leaves_modelopts_preset_as_it_was():
    """Building a config does not change ModelOpt's FP8_DEFAULT_CFG: a later --kv-cache none config in the same
    process has no KV-cache quantizer (Q9: the preset itself extended with FP8_KV_CFG's entries)."""
    import modelopt.torch.quantization as mtq

    before = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    quant_config(mtq, "fp8", "fp8")
    assert mtq.FP8_DEFAULT_CFG == before
    assert "bmm_quantizer" not in json.dumps(quant_config(mtq, "fp8", "none"), default=str)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def test_dtype_is_the_one_asked_for(tmp_path):
    """--dtype bfloat16 loads a float32 checkpoint in bfloat16 (Q15: always as stored)."""
    _tiny_model().save_pretrained(tmp_path)
    assert load_model(tmp_path, "auto", "cpu").dtype == torch.float32
    assert load_model(tmp_path, "bfloat16", "cpu").dtype == torch.bfloat16


def test_a_single_quantizer_left_without_a_scale_is_an_error():
    """A linear layer the forward never reaches gets a weight scale from ModelOpt but no input scale: one quantizer
    without a scale, which would export none, is refused and named (Q23: only two or more were)."""
    model = _tiny_model()
    model.model.unused = torch.nn.Linear(8, 8)
    with pytest.raises(QuantizeError, match=r"calibration left 1 quantizers without a scale \(e\.g\. "
                                            r"model\.unused\.input_quantizer\): the calibration forward never "
                                            r"reached their layers") as e:
        quantize(model, [torch.arange(3, 35)], progress=False)
    # not an attention quantizer: the line blamed ModelOpt's attention hooks and suggested --kv-cache none
    assert "attention" not in str(e.value) and "--kv-cache" not in str(e.value)


WINDOWS = [torch.arange(3, 7) * (k + 1) for k in range(6)]  # six windows of four tokens


def _fresh():
    """The tiny Llama fake-quantized (FP8 weights and KV cache), calibrated on WINDOWS."""
    return quantize(_tiny_model(), WINDOWS, progress=False)


def test_exported_input_scales_are_the_calibration_inputs_max(tmp_path):
    """Each linear layer's exported input_scale is max|input| / 448 over every token of every calibration window,
    measured with torch forward hooks on the unquantized model (Q42: the windows' last tokens left out)."""
    from safetensors.torch import load_file

    from megatron_ext.quantize import export

    model, seen = _tiny_model(), {}

    def hook(name):
        def record(module, args):
            seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))
        return record

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for w in WINDOWS:
            model(input_ids=w[None], use_cache=False)
    t = load_file(export(_fresh(), tmp_path / "fp8") / "model.safetensors")
    assert len(seen) == 7 * TINY["num_hidden_layers"]
    for name, amax in seen.items():
        assert float(t[f"{name}.input_scale"]) == pytest.approx(amax / 448, rel=1e-6), name


def test_export_refuses_an_existing_folder_and_leaves_it_alone(tmp_path):
    """An existing --out, even empty, is refused, not replaced by the checkpoint (Q30: an empty one was renamed
    over); nothing is left beside it."""
    from megatron_ext.quantize import export

    model = _fresh()  # refused before the export packs its weights: usable for the second try
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "mine.txt").write_text("x")
    with pytest.raises(QuantizeError, match="exists: remove it or choose a new directory"):
        export(model, tmp_path / "fp8")
    (tmp_path / "fp8" / "mine.txt").unlink()
    with pytest.raises(QuantizeError, match="exists"):
        export(model, tmp_path / "fp8")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["fp8"]


def test_export_folder_honours_the_umask_and_makes_its_parents(tmp_path):
    """Under umask 027 the export folder is rwxr-x---, as a folder made with os.mkdir (Q31: always 0755, readable to
    all); --out under folders that do not exist yet gets them (Q41: FileNotFoundError after the calibration)."""
    import os
    import stat

    from megatron_ext.quantize import export

    old = os.umask(0o027)
    try:
        out = export(_fresh(), tmp_path / "new" / "deeper" / "fp8")
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    assert (out / "config.json").is_file()
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o750


def test_a_ctrl_c_during_the_export_leaves_nothing(tmp_path):
    """A Ctrl-C (KeyboardInterrupt) while the tokenizer is written, after ModelOpt wrote the weights: neither --out
    nor its temporary folder is left (Q39: only Exception cleaned up, a half-written .fp8.tmp-* stayed)."""
    from megatron_ext.quantize import export

    class InterruptedTokenizer:
        def save_pretrained(self, path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export(_fresh(), tmp_path / "fp8", InterruptedTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_the_package_names_what_it_has_and_only_that():
    """`from megatron_ext.quantize import *` gives the documented names (Q46: none), and a name it does not have is
    an AttributeError, so `hasattr` and `from ... import` of a typo fail (Q45: None)."""
    import megatron_ext.quantize as package

    names: dict = {}
    exec("from megatron_ext.quantize import *", names)
    assert {"quantize", "export", "load_windows", "run_check", "QuantizeError"} <= set(names)
    assert not hasattr(package, "quantise")
    with pytest.raises(ImportError):
        exec("from megatron_ext.quantize import quantise", {})


def test_a_tokenizer_is_optional_unless_asked_for(tmp_path):
    """A model folder without a tokenizer gives none (indexed calibration data needs none); a --tokenizer that cannot
    be loaded is the one line naming it (Q19: the two swapped)."""
    from megatron_ext.quantize import load_tokenizer

    assert load_tokenizer(tmp_path) is None
    with pytest.raises(QuantizeError, match=f"--tokenizer {tmp_path}: cannot load a tokenizer"):
        load_tokenizer(tmp_path, required=True)
    # a config value of the wrong type: transformers raises AttributeError, which was a traceback
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": 5}')
    with pytest.raises(QuantizeError, match=f"--tokenizer {tmp_path}: cannot load a tokenizer \\(AttributeError: "):
        load_tokenizer(tmp_path, required=True)
