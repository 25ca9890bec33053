"""FP8 export with NVIDIA ModelOpt on a tiny random Llama (CPU, fake quantization).

Oracles: torch's own float8_e4m3fn cast (the exported weights must equal W / scale rounded to E4M3,
with scale = max|W| / 448 of the original weights), the original model's logits (transformers),
the planner's KV-cache formula.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from megatron_ext.hf_config import normalize_hf_config

pytest.importorskip("modelopt.torch.quantization")

from megatron_ext.cost_model import kv_cache_bytes_per_token  # noqa: E402
from megatron_ext.presets import TINY  # noqa: E402
from megatron_ext.quantize import (  # noqa: E402
    QuantizeError, load_windows, quantize, quantized_layers, quantizers_disabled, run_check, tensor_quantizers,
)
from megatron_ext.quantize.cli import main  # noqa: E402

E4M3_MAX = 448.0
SEQ = 256
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "One of the special magic numbers is 1234567. What is the special magic number mentioned? ")


def _tokenizer():
    """A real byte-level BPE tokenizer of 512 ids (0 <unk>, 1 <s>, 2 </s>, as TINY's bos/eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([FILLER * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _save_model(path, **changes):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **changes})).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    _save_model(d)
    _tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def token_prefix(tmp_path_factory):
    """40 documents repeating random motifs, written with Megatron-Core's builder (about 6K tokens)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    d = tmp_path_factory.mktemp("data")
    gen = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(d / "docs.bin"), dtype=np.int32)
    for _ in range(40):
        n = int(gen.integers(20, 300))
        doc = np.resize(gen.integers(3, 512, int(gen.integers(4, 24))), n).astype(np.int32)
        builder.add_document(torch.from_numpy(doc), [n])
    builder.finalize(str(d / "docs.idx"))
    return str(d / "docs")


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exported(hf_dir, token_prefix, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "fp8"
    code, stdout, stderr = _cli("--hf", hf_dir, "--out", out, "--calib", token_prefix, "--calib-samples", 4,
                                "--calib-seq-length", SEQ, "--check", "--check-samples", 2)
    assert code == 0, stderr + stdout
    return out, stdout


@pytest.fixture(scope="module")
def quantized(hf_dir, token_prefix):
    """The tiny model fake-quantized in memory (FP8 weights + KV cache), with held-out windows."""
    from transformers import AutoModelForCausalLM

    calib, held = load_windows(token_prefix, samples=4, seq_length=SEQ, held_out=2, vocab_size=TINY["vocab_size"])
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    quantize(model, calib, progress=False)
    return model, held


def test_export_config_and_scales(exported, hf_dir):
    from safetensors.torch import load_file

    out, stdout = exported
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["quant_algo"]) == ("modelopt", "FP8")
    assert q["kv_cache_scheme"]["num_bits"] == 8 and q["kv_cache_scheme"]["type"] == "float"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    # the converter's transformers-4 form, which transformers 4 servers read (ModelOpt wrote rope_parameters)
    source = json.loads((hf_dir / "config.json").read_text())
    want = normalize_hf_config(source)
    assert "rope_parameters" not in cfg and cfg["torch_dtype"] in ("float32", "bfloat16", "float16")
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (want["rope_theta"], want["rope_scaling"])
    assert want["rope_scaling"] is not None  # the tiny model's llama3 scaling: the check above can fail
    t = load_file(out / "model.safetensors")
    orig = load_file(hf_dir / "model.safetensors")
    for i in range(TINY["num_hidden_layers"]):
        for name in LINEARS:
            p = f"model.layers.{i}.{name}"
            assert t[f"{p}.weight"].dtype == torch.float8_e4m3fn, p
            for s in ("weight_scale", "input_scale"):
                assert t[f"{p}.{s}"].numel() == 1 and float(t[f"{p}.{s}"]) > 0, f"{p}.{s}"
            # oracle: per-tensor max calibration, scale = max|W| / 448, then torch's E4M3 rounding
            w = orig[f"{p}.weight"]
            scale = w.abs().max() / E4M3_MAX
            torch.testing.assert_close(t[f"{p}.weight_scale"], scale, rtol=1e-6, atol=0)
            assert torch.equal(t[f"{p}.weight"].float(), (w / t[f"{p}.weight_scale"]).to(torch.float8_e4m3fn).float())
        for kv in ("k", "v"):
            assert float(t[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"]) > 0
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(t[kept], orig[kept]), kept
    report = json.loads((out / "quantize_report.json").read_text())
    assert len(report["layers"]["fp8_linear"]) == len(LINEARS) * TINY["num_hidden_layers"]
    assert report["layers"]["kept"] == ["model.embed_tokens", "lm_head"]
    assert (out / "tokenizer.json").is_file()  # servable as is
    assert f"quantized: {len(LINEARS) * TINY['num_hidden_layers']} linear layers" in stdout
    before, after = kv_cache_bytes_per_token(TINY, 2), kv_cache_bytes_per_token(TINY, 1)
    assert before == 256 and f"KV cache per token: {before:.0f} B (BF16) -> {after:.0f} B (FP8)" in stdout
    assert "checkpoint size:" in stdout and "check: PASS" in stdout
    assert not list(out.parent.glob(".fp8.tmp-*"))


def test_check_table_and_niah_column(exported):
    _, stdout = exported
    assert "ppl orig" in stdout and "logits relative error" in stdout
    try:
        import megatron_ext.evaluate  # noqa: F401
    except ImportError:
        assert "NIAH skipped: megatron_ext.evaluate is not importable" in stdout
    else:
        assert "NIAH fp8" in stdout  # the column exists; lengths shorter than the NIAH prompt say n/a


def test_fake_quant_logits_close_to_original(quantized, hf_dir):
    from transformers import AutoModelForCausalLM

    model, held = quantized
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.stack(held)  # [2, SEQ]
    with torch.no_grad():
        ref = ref_model(x).logits
        fq = model(x).logits
        with quantizers_disabled(model):
            off = model(x).logits
    assert torch.equal(off, ref)  # bypassing the quantizers is exactly the original model
    rel = float((fq - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.08, rel  # measured 0.03-0.04: FP8 E4M3 has 3 mantissa bits
    layers = quantized_layers(model)
    assert len(layers["fp8_kv_cache"]) == TINY["num_hidden_layers"]


def test_check_catches_absurd_scales(quantized):
    model, held = quantized
    good = run_check(model, held, niah=False)
    assert good.passed and good.logits_rel_err < 0.08
    saved = {n: q.amax.clone() for n, q in tensor_quantizers(model) if n.endswith("weight_quantizer") and q.is_enabled}
    try:  # weight scales 1000x too small: every weight clipped to +-max/1000
        for n, q in tensor_quantizers(model):
            if n in saved:
                q.amax = saved[n] * 1e-3
        bad = run_check(model, held, niah=False)
    finally:
        for n, q in tensor_quantizers(model):
            if n in saved:
                q.amax = saved[n]
    assert not bad.passed and bad.logits_rel_err > 0.3 and "logits relative error" in bad.failures[-1]
    assert run_check(model, held, niah=False).logits_rel_err == pytest.approx(good.logits_rel_err)


def test_export_reloads_as_the_fake_quant_model(hf_dir, token_prefix, tmp_path):
    """The exported tensors, dequantized (E4M3 x weight_scale) into a plain transformers Llama, give the
    logits of the fake-quant model with only its weight quantizers on: the export is what was checked."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from megatron_ext.quantize import export

    calib, held = load_windows(token_prefix, samples=2, seq_length=64, held_out=1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    quantize(model, calib, progress=False)
    x = held[0][None]  # [1, 64]
    others = [q for n, q in tensor_quantizers(model) if q.is_enabled and not n.endswith("weight_quantizer")]
    with torch.no_grad():
        for q in others:
            q.disable()
        weight_fq = model(x).logits
    for q in others:
        q.enable()
    out = export(model, tmp_path / "fp8")  # packs model's weights in place: it is not used after this
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    t = load_file(out / "model.safetensors")
    state = {k: (v.float() * t[k[:-len("weight")] + "weight_scale"] if v.dtype == torch.float8_e4m3fn else v)
             for k, v in t.items() if not k.endswith("_scale")}
    plain = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        reloaded = plain(x).logits
    torch.testing.assert_close(reloaded, weight_fq, rtol=1e-5, atol=1e-5)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        assert float((reloaded - ref(x).logits).norm() / ref(x).logits.norm()) > 1e-4  # FP8 did change it


def test_failed_check_writes_nothing(hf_dir, token_prefix, tmp_path):
    out = tmp_path / "fp8"
    code, stdout, stderr = _cli("--hf", hf_dir, "--out", out, "--calib", token_prefix, "--calib-samples", 2,
                                "--calib-seq-length", 64, "--check", "--no-niah", "--max-logits-rel-err", 1e-4)
    assert code == 1 and "check: FAIL" in stdout and "not written" in stderr
    assert not out.exists() and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------ bad input


def _bad(tmp_path, hf, calib, *extra) -> str:
    code, stdout, stderr = _cli("--hf", hf, "--out", tmp_path / "o", "--calib", calib, *extra)
    last = stderr.strip().splitlines()[-1]  # transformers' loading bar may precede it
    assert code == 2 and last.startswith("error: ") and "Traceback" not in stderr, stderr
    assert not (tmp_path / "o").exists()
    return last


def test_missing_architectures(tmp_path, token_prefix):
    cfg = {k: v for k, v in TINY.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert 'no "architectures" field' in _bad(tmp_path, tmp_path, token_prefix)
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools/quantize.py"
    proc = subprocess.run([sys.executable, str(tool), "--hf", str(tmp_path), "--out", str(tmp_path / "o"),
                           "--calib", token_prefix], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr


def test_unsupported_architecture(tmp_path, token_prefix):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["MistralForCausalLM"]}))
    assert "['MistralForCausalLM'] is not supported" in _bad(tmp_path, tmp_path, token_prefix)


def test_calibration_data_too_short(tmp_path, hf_dir, token_prefix):
    msg = _bad(tmp_path, hf_dir, token_prefix, "--calib-samples", 100, "--calib-seq-length", 256)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(token_prefix)  # keep it alive: sequence_lengths is a view of its memory map
    total = int(ds.sequence_lengths.sum())
    assert f"has {total:,} tokens in 40 documents, i.e. {total // 256} windows of 256 tokens" in msg
    assert "100 calibration windows need 25,600 tokens" in msg


def test_kv_cache_fp8_needs_modelopt_support(tmp_path, hf_dir, token_prefix, monkeypatch):
    import modelopt.torch.quantization as mtq

    monkeypatch.delattr(mtq, "FP8_KV_CFG")  # as in a ModelOpt release without FP8 KV-cache support
    assert "has no FP8 KV-cache config (FP8_KV_CFG)" in _bad(tmp_path, hf_dir, token_prefix)
    assert _cli("--hf", hf_dir, "--out", tmp_path / "w", "--calib", token_prefix, "--kv-cache", "none",
                "--calib-samples", 1, "--calib-seq-length", 32)[0] == 0  # the suggested way out works


def test_modelopt_missing(tmp_path, hf_dir, token_prefix, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "modelopt", None)
    assert "pip install 'megatron-ext[quantize]'" in _bad(tmp_path, hf_dir, token_prefix)


def test_bad_calibration_sources(tmp_path, hf_dir, token_prefix):
    assert "not found" in _bad(tmp_path, hf_dir, str(tmp_path / "nope"))
    (tmp_path / "half.bin").write_bytes(b"")
    assert "half.idx is missing" in _bad(tmp_path, hf_dir, str(tmp_path / "half"))
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "big.bin"), dtype=np.int32)
    b.add_document(torch.arange(1000, 1300, dtype=torch.int32), [300])
    b.finalize(str(tmp_path / "big.idx"))
    assert "token id 1063, outside the model's vocabulary of 512" in _bad(
        tmp_path, hf_dir, str(tmp_path / "big"), "--calib-samples", 1, "--calib-seq-length", 64)


def test_out_under_a_file_and_unusable_device(tmp_path, hf_dir, token_prefix):
    """Both ended in tracebacks (FileExistsError at the export, after the calibration; torch's CUDA assert)."""
    (tmp_path / "afile").write_text("x")
    code, _, stderr = _cli("--hf", hf_dir, "--out", tmp_path / "afile/sub", "--calib", token_prefix)
    assert code == 2 and "afile is a file, not a directory" in stderr and "Traceback" not in stderr, stderr
    assert "--device tpu: not a device this tool runs on; give cpu, cuda or cuda:N" in _bad(
        tmp_path, hf_dir, token_prefix, "--device", "tpu")
    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA device is visible to this process" in _bad(
            tmp_path, hf_dir, token_prefix, "--device", "cuda")


def test_existing_output_refused(tmp_path, hf_dir, token_prefix):
    (tmp_path / "o").mkdir()
    code, _, stderr = _cli("--hf", hf_dir, "--out", tmp_path / "o", "--calib", token_prefix)
    assert code == 2 and "exists" in stderr


def test_check_samples_at_least_one(tmp_path, hf_dir, token_prefix):
    """--check-samples 0 calibrated, then ended in an IndexError traceback."""
    assert "--check-samples 0: the held-out windows --check compares, a number >= 1" in _bad(
        tmp_path, hf_dir, token_prefix, "--check", "--check-samples", "0")


def test_the_evaluation_refuses_an_fp8_export(tmp_path, hf_dir):
    """transformers skips ModelOpt's quantization_config: the FP8 codes loaded as plain numbers (q_proj up to 448
    instead of 0.07), and NIAH on the deployed folder scored a garbage model without an error."""
    import shutil

    from megatron_ext.evaluate import EvalError
    from megatron_ext.evaluate.loading import load_hf

    folder = tmp_path / "fp8"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EvalError, match="is a ModelOpt FP8 export .* evaluate the BF16 folder it came from"):
        load_hf(folder, "cpu")
    load_hf(hf_dir, "cpu")  # control: the BF16 source loads


@pytest.mark.parametrize("flag", [["--no-niah"], ["--check-samples", "3"], ["--max-logits-rel-err", "0.5"]])
def test_check_options_need_check(tmp_path, hf_dir, token_prefix, flag):
    """They were ignored without a word: the export went out unchecked."""
    assert f"{flag[0]} sets the accuracy check, which runs with --check only: add --check" in _bad(
        tmp_path, hf_dir, token_prefix, *flag)


# ------------------------------------------------------------------------------- calibration data


def test_windows_pack_documents_in_order(token_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(token_prefix)
    flat = np.concatenate([ds[i] for i in range(len(ds))])
    calib, held = load_windows(token_prefix, samples=3, seq_length=100, held_out=2)
    got = torch.cat(calib + held).numpy()
    assert [len(w) for w in calib + held] == [100] * 5 and np.array_equal(got, flat[:500])
    with pytest.raises(QuantizeError, match="lower --calib-samples"):
        load_windows(token_prefix, samples=len(flat) // 100 + 1, seq_length=100)


def test_windows_from_text_files(tmp_path, hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    (tmp_path / "a.txt").write_text(FILLER * 3)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": FILLER}) + "\n")
    calib, _ = load_windows(str(tmp_path), samples=2, seq_length=16, tokenizer=tok)
    expect = np.concatenate([tok(FILLER * 3)["input_ids"], tok(FILLER)["input_ids"]])  # sorted: a.txt, b.jsonl
    assert np.array_equal(torch.cat(calib).numpy(), expect[:32])
    with pytest.raises(QuantizeError, match="needs a tokenizer"):
        load_windows(str(tmp_path / "a.txt"), samples=1, seq_length=16)


# ----------------------------------------------------------------------------------- serving memory


def test_serving_memory_llama31_8b():
    from pathlib import Path

    from megatron_ext.presets import LLAMA31_8B
    from megatron_ext.quantize import format_serving_table, serving_memory, weight_bytes
    from megatron_ext.quantize.report import GIB

    rows = serving_memory(LLAMA31_8B)
    # paper.md section 7: 128 KiB per token in BF16, 128 GiB at 1M, 512 GiB at 4M
    assert [r["kv_bf16"] / GIB for r in rows] == [128, 256, 512]
    assert [r["kv_fp8"] / GIB for r in rows] == [64, 128, 256]
    # 8,030,261,248 parameters; 6,979,321,856 of them in the decoder's linear layers go to 1 byte
    assert weight_bytes(LLAMA31_8B, "none") == 2 * 8_030_261_248
    assert weight_bytes(LLAMA31_8B) == 6_979_321_856 + 2 * (8_030_261_248 - 6_979_321_856)
    assert rows[0]["saved"] == rows[0]["bf16"] - rows[0]["fp8"]
    kv_only = serving_memory(LLAMA31_8B, weights="none")
    assert kv_only[2]["saved"] == 256 * GIB
    doc = (Path(__file__).resolve().parents[2] / "docs/serving.md").read_text()
    assert format_serving_table(rows) in doc  # the documented numbers are the computed ones


# ------------------------------------------------------------------------------ pins (mutation audit)


def test_check_numbers_are_transformers_own(quantized, hf_dir, monkeypatch):
    """run_check's numbers against plain computations: each length's perplexity is exp of transformers' own
    causal-LM loss (labels=input_ids: token t+1 predicted from tokens <= t) of the original model and of the
    fake-quant one on the windows cut to that length; the logits error ||Lq - L|| / ||L|| and the top-1 agreement
    from both models' full logits. With LOGIT_CHUNK 100 a window's logits come in several lm_head chunks."""
    from transformers import AutoModelForCausalLM

    import megatron_ext.quantize.check as check

    model, held = quantized
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.stack(held)  # [2, SEQ]
    ppl = {}
    with torch.no_grad():
        for n in (64, 200, SEQ):
            ppl[n] = (math.exp(float(ref_model(x[:, :n], labels=x[:, :n]).loss)),
                      math.exp(float(model(x[:, :n], labels=x[:, :n]).loss)))
        ref, fq = ref_model(x).logits.double(), model(x).logits.double()  # [2, SEQ, V]
    rel = float((fq - ref).norm() / ref.norm())
    top1 = float((fq.argmax(-1) == ref.argmax(-1)).double().mean())
    assert 0 < rel and top1 < 1  # FP8 changed something: the checks below can fail
    monkeypatch.setattr(check, "LOGIT_CHUNK", 100)  # 3 chunks a window (the default's one: other tests)
    r = run_check(model, held, lengths=[200, SEQ, 64], niah=False)
    assert [row["length"] for row in r.rows] == [64, 200, SEQ]
    for row in r.rows:
        p_ref, p_q = ppl[row["length"]]
        assert row["ppl_orig"] == pytest.approx(p_ref, rel=1e-5) and row["ppl_fp8"] == pytest.approx(p_q, rel=1e-5)
        assert row["ppl_increase"] == pytest.approx(p_q / p_ref - 1, abs=1e-6)
    assert r.ppl_increase == pytest.approx(ppl[SEQ][1] / ppl[SEQ][0] - 1, abs=1e-6)  # the longest length's
    assert r.logits_rel_err == pytest.approx(rel, rel=1e-4) and r.top1_agreement == pytest.approx(top1, abs=1e-9)


def test_check_lengths_halve_down_from_the_window():
    from megatron_ext.quantize.check import check_lengths

    assert check_lengths(1 << 20) == [1 << 18, 1 << 19, 1 << 20]  # the docstring's 1M -> [256K, 512K, 1M]
    assert check_lengths(256, 2) == [128, 256] and check_lengths(3) == [2, 3]  # never below 2 tokens


def test_weights_none_exports_only_the_kv_cache_scales(hf_dir, token_prefix, tmp_path):
    """--weights none --kv-cache fp8: every linear layer as stored (no FP8 weight, no weight/input scale), only the
    k_scale/v_scale of each attention layer added. Oracle: the original safetensors."""
    from safetensors.torch import load_file

    out = tmp_path / "kv"
    code, stdout, stderr = _cli("--hf", hf_dir, "--out", out, "--calib", token_prefix, "--weights", "none",
                                "--calib-samples", 1, "--calib-seq-length", 32)
    assert code == 0, stderr + stdout
    t, orig = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert not [k for k in t if k.endswith(("weight_scale", "input_scale"))]
    assert all(torch.equal(t[k], v) for k, v in orig.items())
    for i in range(TINY["num_hidden_layers"]):
        for kv in ("k", "v"):
            assert float(t[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"]) > 0
    assert "quantized: 0 linear layers" in stdout


def test_kv_cache_quantizers_that_modelopt_did_not_insert_are_an_error(hf_dir, token_prefix, monkeypatch):
    """A ModelOpt whose KV-cache config names quantizers this model does not have (its attention not hooked) would
    export no k_scale/v_scale while --kv-cache fp8 was asked; quantize says so."""
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    calib, _ = load_windows(token_prefix, samples=1, seq_length=32)
    monkeypatch.setattr(mtq, "FP8_KV_CFG", {"quant_cfg": [{"quantizer_name": "*nowhere_bmm_quantizer",
                                                           "cfg": {"num_bits": (4, 3), "axis": None}}]})
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with pytest.raises(QuantizeError, match="inserted no KV-cache quantizers"):
        quantize(model, calib, progress=False)


def test_export_folder_mode_and_a_failed_export_leaves_nothing(hf_dir, token_prefix, tmp_path):
    """The export folder gets the mode a folder made the usual way gets (mkdtemp's is 0700: unreadable to the
    serving user); an export that fails partway leaves neither the folder nor its temporary."""
    import stat

    from transformers import AutoModelForCausalLM

    from megatron_ext.quantize import export

    calib, _ = load_windows(token_prefix, samples=1, seq_length=32)

    def fresh():
        return quantize(AutoModelForCausalLM.from_pretrained(hf_dir).eval(), calib, progress=False)

    (tmp_path / "plain").mkdir()
    out = export(fresh(), tmp_path / "fp8")
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(FileNotFoundError):  # after ModelOpt wrote the weights
        export(fresh(), bad / "fp8", extra_files={"no/such/folder.txt": "x"})
    assert list(bad.iterdir()) == []


def test_checkpoint_bytes_counts_weight_files_only(tmp_path):
    from megatron_ext.quantize.fp8 import checkpoint_bytes

    for name, size in (("a.safetensors", 10), ("b.bin", 20), ("c.pt", 30), ("config.json", 7), ("t.model", 5)):
        (tmp_path / name).write_bytes(b"\0" * size)
    (tmp_path / "sub.safetensors").mkdir()
    assert checkpoint_bytes(tmp_path) == 60


def test_serving_memory_with_the_kv_cache_unchanged():
    """--kv-cache none: the KV cache stays BF16 (128 KiB a token for Llama-3.1-8B: 32 layers x 8 KV heads x 128 x
    K and V x 2 B); only the weights shrink, by one byte per linear-layer parameter."""
    from megatron_ext.presets import LLAMA31_8B
    from megatron_ext.quantize import format_report, serving_memory
    from megatron_ext.quantize.report import GIB

    rows = serving_memory(LLAMA31_8B, kv_cache="none")
    assert [r["kv_fp8"] / GIB for r in rows] == [r["kv_bf16"] / GIB for r in rows] == [128, 256, 512]
    assert [r["saved"] for r in rows] == [6_979_321_856] * 3
    layers = {"fp8_linear": [], "fp8_kv_cache": [], "kept": []}
    text = format_report(LLAMA31_8B, layers, 2 << 20, 1 << 20, "none", "fp8")
    assert "KV cache per token: 131,072 B (BF16) -> 131,072 B (BF16)" in text and "(0.50x)" in text


@pytest.mark.parametrize("top, ok", [(511, True), (512, False)])
def test_calibration_token_ids_at_the_vocabulary_edge(tmp_path, top, ok):
    """ids 0..vocab_size-1 are the model's; vocab_size itself is one past the embedding table."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    b.add_document(torch.tensor([5] * 40 + [top] + [7] * 23, dtype=torch.int32), [64])
    b.finalize(str(tmp_path / "d.idx"))
    if ok:
        load_windows(str(tmp_path / "d"), samples=1, seq_length=32, held_out=1, vocab_size=512)
    else:  # the id sits in the held-out window: it is run through the model too
        with pytest.raises(QuantizeError, match="token id 512, outside the model's vocabulary of 512"):
            load_windows(str(tmp_path / "d"), samples=1, seq_length=32, held_out=1, vocab_size=512)


def test_negative_calibration_token_ids_are_refused(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    b.add_document(torch.tensor([5] * 20 + [-1] + [7] * 11, dtype=torch.int32), [32])
    b.finalize(str(tmp_path / "d.idx"))
    with pytest.raises(QuantizeError, match="outside the model's vocabulary of 512"):
        load_windows(str(tmp_path / "d"), samples=1, seq_length=32, vocab_size=512)


def test_windows_use_data_of_exactly_the_needed_length(tmp_path):
    """Two documents of 40 and 88 tokens fill exactly 2 windows of 64 (packed across the boundary, in order);
    asking one more is too short, naming all 128 tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    b.add_document(torch.arange(3, 43, dtype=torch.int32), [40])
    b.add_document(torch.arange(100, 188, dtype=torch.int32), [88])
    b.finalize(str(tmp_path / "d.idx"))
    calib, held = load_windows(str(tmp_path / "d"), samples=1, seq_length=64, held_out=1)
    flat = np.concatenate([np.arange(3, 43), np.arange(100, 188)])
    assert np.array_equal(calib[0].numpy(), flat[:64]) and np.array_equal(held[0].numpy(), flat[64:])
    with pytest.raises(QuantizeError, match="has 128 tokens in 2 documents, i.e. 2 windows of 64"):
        load_windows(str(tmp_path / "d"), samples=2, seq_length=64, held_out=1)


def test_windows_stop_reading_once_full():
    """The documents are read only until the windows are full: a Hugging Face dataset is streamed (all of it, for
    a large corpus, otherwise)."""
    from megatron_ext.quantize.calib import _windows

    def docs():
        for _ in range(4):
            yield np.arange(10)
        raise AssertionError("read past the last window")

    windows, tokens, n = _windows(docs(), 15, 2)
    assert [w.tolist() for w in windows] == [list(range(10)) + list(range(5)), list(range(5, 10)) + list(range(10))]
    assert (tokens, n) == (30, 3)


@pytest.mark.parametrize("orig, fp8, passed", [(1.0, 0.5, False), (0.5, 1.0, True), (1.0, 0.85, True)])
def test_check_fails_on_a_niah_drop_only(quantized, monkeypatch, orig, fp8, passed):
    """NIAH accuracy that falls by more than --max-niah-drop (0.2) under FP8 fails the check; one that rises does
    not. The tiny random model finds no needle, so NIAH's scores are stood in for (the one thing stubbed): `orig`
    with the quantizers bypassed, `fp8` with them on."""
    from types import SimpleNamespace

    import megatron_ext.evaluate

    model, held = quantized

    def niah(m, tokenizer, lengths, depths, **_):
        on = any(q.is_enabled for _, q in tensor_quantizers(m))
        return SimpleNamespace(scores=[[fp8 if on else orig]] * len(depths))

    monkeypatch.setattr(megatron_ext.evaluate, "run_niah", niah)
    r = run_check(model, held, tokenizer=object(), lengths=[SEQ], max_ppl_increase=1.0, max_logits_rel_err=1.0)
    assert (r.rows[0]["niah_orig"], r.rows[0]["niah_fp8"]) == (orig, fp8)
    assert r.passed is passed and r.failures == ([] if passed else [f"NIAH at {SEQ} tokens fell 1.00 -> 0.50"])


def test_text_folder_documents_in_path_order(tmp_path, hf_dir):
    """A folder's text files are read in sorted path order, sub-folders included (not the file system's listing
    order), so that the same folder always gives the same windows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    texts = {"b.txt": "The grass is green. " * 4, "a/z.jsonl": "The sky is blue. " * 4, "c.md": "Here we go. " * 4}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": text}) + "\n" if name.endswith(".jsonl") else text)
    expect = np.concatenate([tok(texts[n])["input_ids"] for n in ("a/z.jsonl", "b.txt", "c.md")])
    calib, _ = load_windows(str(tmp_path), samples=1, seq_length=len(expect), tokenizer=tok)
    assert np.array_equal(calib[0].numpy(), expect)
