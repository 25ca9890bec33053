"""--verify when the stored dtype is narrower than the source (bf16 / fp16 copies of an fp32 model).

The oracle is the source model with its weights rounded to the stored dtype, so a correct conversion
matches to float32 noise at the default tolerance (1e-4), while a wrong mapping still fails at bf16.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_ext.convert import ConvertError, mapping, to_hf, to_megatron
from tests.unit.test_convert_fixtures import make_hf_model

TOL = 1e-4  # the default --tolerance


@pytest.fixture(scope="module")
def fp32_src(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("verify") / "hf")  # fp32 weights, config says float32


@pytest.fixture(scope="module")
def fp32_ckpt(fp32_src, tmp_path_factory, cpu_parallel_state):
    out = tmp_path_factory.mktemp("verify_m") / "m"
    to_megatron(fp32_src, out, progress=False)
    return out


def test_import_to_bf16_of_fp32_source_verifies(fp32_src, tmp_path, cpu_parallel_state):
    r = to_megatron(fp32_src, tmp_path / "m", dtype="bf16", verify=True, progress=False)
    assert r["dtype"] == "bfloat16" and r["max_abs_logit_diff"] <= TOL
    # the weights are stored as bf16, not only reported so (mutation audit round 5: an fp32 checkpoint passed)
    from megatron_ext.convert.dist_reader import TorchDistReader

    reader = TorchDistReader(tmp_path / "m/iter_0000000")
    for key in ("embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight",
                "decoder.layers.mlp.linear_fc1.weight", "output_layer.weight"):
        assert reader.dtype(key) == torch.bfloat16, key
    # --tolerance is the bound: below this conversion's own difference (float32 noise) --verify refuses it
    diff = r["max_abs_logit_diff"]
    assert diff > 0
    with pytest.raises(ConvertError, match="--verify: max"):
        to_megatron(fp32_src, tmp_path / "m2", dtype="bf16", verify=True, tolerance=diff / 2, progress=False)
    assert not (tmp_path / "m2").exists()


def test_import_config_declares_bf16_but_weights_are_fp32(fp32_src, tmp_path, cpu_parallel_state):
    d = tmp_path / "hf"
    shutil.copytree(fp32_src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"  # the stored dtype follows the config: a bf16 checkpoint of fp32 weights
    (d / "config.json").write_text(json.dumps(cfg))
    r = to_megatron(d, tmp_path / "m", verify=True, progress=False)
    assert r["dtype"] == "bfloat16" and r["max_abs_logit_diff"] <= TOL


@pytest.mark.parametrize("dtype, name", [("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")])
def test_export_to_narrower_dtype_verifies(dtype, name, fp32_ckpt, tmp_path, cpu_parallel_state):
    r = to_hf(fp32_ckpt, tmp_path / "h", dtype=dtype, verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL
    assert r["dtype"] == name  # same form as to-megatron's report ("float32", not "torch.float32")
    assert json.loads((tmp_path / "h/config.json").read_text())["torch_dtype"] == name
    from transformers import LlamaConfig

    # what transformers reads: the source's "dtype" (float32, transformers 5's key) left beside it won (audit round 5)
    assert LlamaConfig.from_pretrained(str(tmp_path / "h")).dtype == getattr(torch, name)
    if dtype == "bf16":  # --tolerance is the bound: below this export's own difference --verify refuses it
        diff = r["max_abs_logit_diff"]
        assert diff > 0
        with pytest.raises(ConvertError, match="--verify: max"):
            to_hf(fp32_ckpt, tmp_path / "h2", dtype=dtype, verify=True, tolerance=diff / 2, progress=False)
        assert not (tmp_path / "h2").exists()


# ---- negative controls: rounding the oracle does not hide a wrong mapping -----------------------

def _swap_q_heads(q, k, v, heads, groups):
    d = k.shape[0] // groups
    q = q.reshape(heads, d, -1)[[1, 0, *range(2, heads)]].reshape(heads * d, -1)
    return _real_merge(q, k, v, heads, groups)


_real_merge = mapping.merge_qkv


def test_wrong_import_mapping_fails_verify_at_bf16(fp32_src, tmp_path, cpu_parallel_state, monkeypatch):
    monkeypatch.setattr(mapping, "merge_qkv", _swap_q_heads)
    with pytest.raises(ConvertError, match="--verify"):
        to_megatron(fp32_src, tmp_path / "bad", dtype="bf16", verify=True, progress=False)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wrong_export_mapping_fails_verify_narrow(dtype, fp32_ckpt, tmp_path, cpu_parallel_state, monkeypatch):
    real = mapping.to_hf

    def gate_up_swapped(entry, t, cfg):
        out = real(entry, t, cfg)
        return out[::-1] if entry.kind == "gate_up" else out

    monkeypatch.setattr(mapping, "to_hf", gate_up_swapped)
    with pytest.raises(ConvertError, match="--verify"):
        to_hf(fp32_ckpt, tmp_path / "bad", dtype=dtype, verify=True, progress=False)
    assert not (tmp_path / "bad").exists()


def test_round_params_matches_a_stored_copy():
    """The oracle's rounding equals what a bf16 / fp16 copy holds (one round-to-nearest, no double rounding)."""
    from megatron_ext.convert.verify import round_params_

    lin = torch.nn.Linear(64, 64)
    for dtype in (torch.bfloat16, torch.float16):
        ref = lin.weight.detach().to(dtype)
        m = torch.nn.Linear(64, 64)
        m.load_state_dict(lin.state_dict())
        round_params_(m, {"weight": dtype})
        assert torch.equal(m.weight, ref.float()) and torch.equal(m.bias, lin.bias)  # bias not listed: kept


def _with_weight(src, out, value):
    """A copy of HF folder `src` whose final norm's first weight is `value`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"][0] = value
            save_file(tensors, f, metadata={"format": "pt"})
    return out


def test_verify_refuses_nan_logits(fp32_src, tmp_path, cpu_parallel_state):
    """NaN logits compared as no difference (nan > tolerance is False): a diverged model verified."""
    nan = _with_weight(fp32_src, tmp_path / "nan", float("nan"))
    with pytest.raises(ConvertError, match=r"--verify: the Hugging Face model's and the Megatron checkpoint's logits "
                                           r"are not finite \(NaN or Inf\)"):
        to_megatron(nan, tmp_path / "m", verify=True, progress=False)
    assert not (tmp_path / "m").exists()


def test_export_refuses_weights_beyond_the_dtype(fp32_src, tmp_path, cpu_parallel_state):
    """fp16 holds at most 65504: 70000 became Inf, in the file and in --verify's rounded oracle alike."""
    big = to_megatron(_with_weight(fp32_src, tmp_path / "big", 7e4), tmp_path / "m", progress=False)
    assert big["dtype"] == "float32"
    with pytest.raises(ConvertError, match=r"decoder\.final_layernorm\.weight holds NaN or Inf values as float16 "
                                           r"\(HF model\.norm\.weight\)"):
        to_hf(tmp_path / "m", tmp_path / "h", dtype="fp16", progress=False)
    assert not (tmp_path / "h").exists()
    to_hf(tmp_path / "m", tmp_path / "h", dtype="bf16", progress=False)  # control: bf16 has fp32's range


# ---- pins of the mutation audit (round 5) -------------------------------------------------------

def test_compare_logits_is_the_largest_difference(fp32_src, fp32_ckpt, tmp_path, cpu_parallel_state):
    """compare_logits reports the largest |logit difference|, not an average: one output row changed (token 7's
    lm_head row + 1) moves one column of the vocabulary, and the check reports that column's change. Oracle:
    transformers' logits of the two HF folders (the checkpoint is the unchanged one)."""
    from safetensors.torch import load_file, save_file

    from megatron_ext.convert.verify import compare_logits, hf_logits, random_tokens

    d = tmp_path / "hf"
    shutil.copytree(fp32_src, d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"][7] += 1.0
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    tokens = random_tokens(json.loads((d / "config.json").read_text())["vocab_size"], 2, 32, 0)  # compare_logits' own
    moved = (hf_logits(d, tokens) - hf_logits(fp32_src, tokens)).abs().max().item()
    assert moved > 10 * TOL
    assert compare_logits(d, fp32_ckpt) == pytest.approx(moved, rel=1e-3, abs=TOL)


def test_rope_check_sees_a_small_theta_change(fp32_src):
    """check_rope_far_out refuses a rope whose inverse frequencies are up to 9e-4 apart (theta 0.1% off): tighter
    than the 1e-2 that would let it through. Oracle: transformers' rope of the HF folder."""
    from megatron_ext.convert.verify import check_rope_far_out
    from megatron_ext.hf_config import normalize_hf_config

    cfg = normalize_hf_config(json.loads((fp32_src / "config.json").read_text()))
    assert check_rope_far_out(fp32_src, cfg, "the folder") == 2 * cfg["max_position_embeddings"]
    with pytest.raises(ConvertError, match="inverse frequencies .* apart"):
        check_rope_far_out(fp32_src, dict(cfg, rope_theta=cfg["rope_theta"] * 1.001), "the folder")


def test_rope_check_sees_another_attention_factor(tmp_path):
    """yarn with attention_factor 1.5 has the same inverse frequencies as yarn without it (factor 8: 1 + 0.1 ln 8 =
    1.21), only another attention scale: check_rope_far_out compares the factor too. Oracle: transformers' yarn."""
    from megatron_ext.convert.verify import check_rope_far_out
    from megatron_ext.hf_config import normalize_hf_config
    from tests.unit.test_convert_fixtures import VARIANTS

    src = make_hf_model(tmp_path / "hf", tokenizer=False, **VARIANTS["yarn-gqa2"])
    cfg = normalize_hf_config(json.loads((src / "config.json").read_text()))
    check_rope_far_out(src, cfg, "the folder")
    other = dict(cfg, rope_scaling=dict(cfg["rope_scaling"], attention_factor=1.5))
    with pytest.raises(ConvertError, match=r"inverse frequencies 0\.0e\+00 apart, attention factor 1\.208 vs 1\.5;"):
        check_rope_far_out(src, other, "the folder")
