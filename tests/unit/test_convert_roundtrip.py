"""HF -> Megatron -> HF on tiny random Llama-3.1 models: bit-exact tensors and rope fields, equal logits.

Oracle: transformers' LlamaForCausalLM. Negative controls show that the logit check catches a
scrambled QKV mapping and a dropped rope block.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors import safe_open

from megatron_ext.checkpoint_layout import read_metadata
from megatron_ext.convert import ConvertError, hf_io, mapping, to_hf, to_megatron
from megatron_ext.convert.verify import hf_logits, megatron_logits, random_tokens
from tests.unit.test_convert_fixtures import VARIANTS, make_hf_model, rope_fields

to_megatron_mod = importlib.import_module("megatron_ext.convert.importer")
TOL = 1e-4  # issue 4: fp32 logits within 1e-4


def read_all(hf_dir) -> dict[str, torch.Tensor]:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text()) \
        if (hf_dir / "model.safetensors.index.json").is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(hf_dir / f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(params=list(VARIANTS))
def converted(request, tmp_path, cpu_parallel_state):
    name = request.param
    src = make_hf_model(tmp_path / "hf", **VARIANTS[name])
    to_megatron(src, tmp_path / "mcore", progress=False)
    to_hf(tmp_path / "mcore", tmp_path / "back", progress=False, max_shard_bytes=60_000)  # several shards
    return name, src, tmp_path


def test_round_trip_bit_exact(converted):
    name, src, tmp = converted
    a, b = read_all(src), read_all(tmp / "back")
    a.pop("lm_head.weight", None) if VARIANTS[name].get("tie_word_embeddings") else None
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, tmp / "back"))
    assert rope_fields(src_cfg) == rope_fields(out_cfg)
    assert "rope_theta" in out_cfg and "rope_scaling" in out_cfg and "rope_parameters" not in out_cfg
    for key in ("vocab_size", "tie_word_embeddings", "num_key_value_heads", "max_position_embeddings"):
        assert src_cfg.get(key) == out_cfg.get(key), key
    # transformers reads the exported transformers-4 form into the same rope parameters as the source
    from transformers import LlamaConfig

    assert LlamaConfig.from_pretrained(str(src)).rope_parameters == \
        LlamaConfig.from_pretrained(str(tmp / "back")).rope_parameters
    index = json.loads((tmp / "back/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp / "back" / f).is_file(), f
    # the source's generation_config.json (transformers' own) comes back verbatim, not one made from config.json's
    # token ids (mutation audit round 5)
    assert json.loads((tmp / "back/generation_config.json").read_text()) == \
        json.loads((src / "generation_config.json").read_text())


def test_megatron_logits_equal_hf(converted):
    name, src, tmp = converted
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(vocab, batch=2, seq_len=48)  # longer than llama3/yarn's original 32 positions
    ref = hf_logits(src, tokens)
    ours = megatron_logits(tmp / "mcore", tokens)
    assert ours.shape == ref.shape  # padded vocab rows dropped
    diff = (ref - ours).abs().max().item()
    assert diff <= TOL, (name, diff)


def test_metadata_and_padding(converted):
    name, src, tmp = converted
    meta = read_metadata(tmp / "mcore")
    assert meta["iteration"] == 0 and meta["tokenizer"] == str(src.resolve())
    assert rope_fields(meta["hf_config"]) == rope_fields(json.loads((src / "config.json").read_text()))
    assert meta["versions"]["megatron-core"].startswith("0.16") and "git_sha" in meta
    from megatron.core import dist_checkpointing

    plain = dist_checkpointing.load_plain_tensors(str(tmp / "mcore/iter_0000000"))
    emb = plain["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 512  # 500 is padded to a multiple of 128
    assert ("output_layer.weight" in plain) == (not VARIANTS[name].get("tie_word_embeddings", False))
    if name == "tied-padded-vocab":
        assert not emb[500:].any()
        assert read_all(tmp / "back")["model.embed_tokens.weight"].shape == (500, 64)


# ---- negative controls: the logit check fails when the mapping or the rope is wrong -------------

def _diff(src, root, seq_len=48):
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tokens = random_tokens(vocab, batch=2, seq_len=seq_len)
    return (hf_logits(src, tokens) - megatron_logits(root, tokens)).abs().max().item()


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("neg") / "hf")


def _permute_q_heads(q, k, v, heads, groups):
    d = k.shape[0] // groups
    q = q.reshape(heads, d, -1)[[1, 0, *range(2, heads)]].reshape(heads * d, -1)  # swap heads 0 and 1
    return _merge(q, k, v, heads, groups)


_merge = mapping.merge_qkv


@pytest.mark.parametrize("bad_merge", [
    _permute_q_heads,
    lambda q, k, v, heads, groups: torch.cat([q, k, v]),  # [all q; all k; all v], not grouped per KV head
], ids=["q-heads-permuted", "qkv-not-grouped"])
def test_scrambled_qkv_fails_logit_check(bad_merge, tiny_src, tmp_path, cpu_parallel_state, monkeypatch):
    monkeypatch.setattr(mapping, "merge_qkv", bad_merge)
    to_megatron(tiny_src, tmp_path / "bad", progress=False)
    assert _diff(tiny_src, tmp_path / "bad") > 10 * TOL
    with pytest.raises(ConvertError, match="--verify"):
        to_megatron(tiny_src, tmp_path / "bad2", verify=True, progress=False)
    assert not (tmp_path / "bad2").exists() and not list(tmp_path.glob(".bad2*"))  # nothing half-written


@pytest.mark.parametrize("variant", ["llama3-gqa2", "dynamic-gqa2", "longrope-gqa2"])
def test_dropped_rope_block_fails_logit_check(variant, tmp_path, cpu_parallel_state, monkeypatch):
    """Each rope's scaled branch is what the logit checks see at their 48 tokens (dynamic: beyond its 32 positions;
    longrope: its long factors), so a converter that lost the block fails them."""
    tiny_src = make_hf_model(tmp_path / "hf", **VARIANTS[variant])
    real = to_megatron_mod.read_hf_config
    monkeypatch.setattr(to_megatron_mod, "read_hf_config", lambda d: dict(real(d), rope_scaling=None))
    to_megatron(tiny_src, tmp_path / "norope", progress=False)
    assert _diff(tiny_src, tmp_path / "norope") > 10 * TOL
    monkeypatch.undo()
    # and on export: an HF config without the rope block computes other logits than the checkpoint
    to_megatron(tiny_src, tmp_path / "good", verify=True, progress=False)
    real_export = hf_io.export_config
    monkeypatch.setattr("megatron_ext.convert.exporter.export_config",
                        lambda *a: dict(real_export(*a), rope_scaling=None))
    # the logits see 32 tokens, within dynamic's 32 positions: its loss shows in the rope check at 64
    match = "--verify: at 64 tokens the rope transformers reads" if variant == "dynamic-gqa2" else "--verify"
    with pytest.raises(ConvertError, match=match):
        to_hf(tmp_path / "good", tmp_path / "back", verify=True, progress=False)
    assert not (tmp_path / "back").exists()


def test_verify_passes_both_ways_in_bf16(tiny_src, tmp_path, cpu_parallel_state):
    r1 = to_megatron(tiny_src, tmp_path / "m", dtype="bf16", verify=False, progress=False)
    assert r1["dtype"] == "bfloat16"
    r2 = to_hf(tmp_path / "m", tmp_path / "h", verify=True, progress=False, tolerance=1e-2)
    assert r2["max_abs_logit_diff"] <= 1e-4  # same bf16 weights on both sides, computed in fp32
    assert json.loads((tmp_path / "h/config.json").read_text())["torch_dtype"] == "float32"  # source dtype


@pytest.mark.parametrize("preset, factor", [("ultralong-1m", 128.0), ("ultralong-2m", 256.0), ("ultralong-4m", 512.0)])
def test_rope_preset_export(preset, factor, tiny_src, tmp_path, cpu_parallel_state):
    to_megatron(tiny_src, tmp_path / "m", progress=False)
    to_hf(tmp_path / "m", tmp_path / "h", rope_preset=preset, progress=False)
    cfg = json.loads((tmp_path / "h/config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 8192,
                                   "beta_fast": 4.0, "beta_slow": 1.0}
    assert cfg["max_position_embeddings"] == int(8192 * factor) and cfg["rope_theta"] == 500000.0
    from transformers import LlamaConfig

    rp = LlamaConfig.from_pretrained(str(tmp_path / "h")).rope_parameters  # transformers 5 reads the v4 form
    assert (rp["rope_type"], rp["factor"], rp["beta_fast"], rp["beta_slow"]) == ("yarn", factor, 4.0, 1.0)


def test_max_position_embeddings_override(tiny_src, tmp_path, cpu_parallel_state):
    to_megatron(tiny_src, tmp_path / "m", progress=False)
    to_hf(tmp_path / "m", tmp_path / "h", max_position_embeddings=65536, progress=False)
    cfg = json.loads((tmp_path / "h/config.json").read_text())
    assert cfg["max_position_embeddings"] == 65536
    assert rope_fields(cfg) == rope_fields(json.loads((tiny_src / "config.json").read_text()))  # rope kept


def test_yarn_trained_checkpoint_exports_with_preset(tmp_path, cpu_parallel_state):
    """A model whose metadata rope is UltraLong-1M exports with that preset and verifies; 4M does not."""
    from megatron_ext.presets import ROPE_PRESETS

    rope = {k: v for k, v in ROPE_PRESETS["ultralong-1m"].items() if k != "rope_theta"}
    src = make_hf_model(tmp_path / "hf", rope_theta=500000.0, rope_scaling=rope, max_position_embeddings=2**20)
    to_megatron(src, tmp_path / "m", progress=False)
    r = to_hf(tmp_path / "m", tmp_path / "h1", rope_preset="ultralong-1m", verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL and "rope_changed" not in r
    with pytest.raises(ConvertError, match="--verify"):  # a different rope computes other logits
        to_hf(tmp_path / "m", tmp_path / "h4", rope_preset="ultralong-4m", verify=True, progress=False)
    r4 = to_hf(tmp_path / "m", tmp_path / "h4", rope_preset="ultralong-4m", progress=False)
    assert "rope_changed" in r4


def test_float32_angle_precision_survives_the_round_trip(tmp_path, cpu_parallel_state):
    """`rope_angle_precision: float32` (a model trained with `rope.angle_precision: float32`) goes into the
    checkpoint's metadata and back into the exported config.json, also under --rope-preset, where the evaluation's
    transformers engine reads it (it then keeps transformers' own float32 angles)."""
    from megatron_ext.evaluate.hf_rope import Float64RotaryAngles
    from megatron_ext.evaluate.loading import load_hf
    from tests.unit.test_evaluate import make_tokenizer

    tok = make_tokenizer()
    src = make_hf_model(tmp_path / "hf", rope_angle_precision="float32")
    to_megatron(src, tmp_path / "m", progress=False)
    assert read_metadata(tmp_path / "m")["hf_config"]["rope_angle_precision"] == "float32"
    r = to_hf(tmp_path / "m", tmp_path / "h", verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL
    to_hf(tmp_path / "m", tmp_path / "h1", rope_preset="ultralong-1m", rope_differs_ok=True, progress=False)
    for out in ("h", "h1"):
        assert json.loads((tmp_path / out / "config.json").read_text())["rope_angle_precision"] == "float32"
    model, _ = load_hf(tmp_path / "h", device="cpu", tokenizer=tok)
    assert not isinstance(model.model.rotary_emb, Float64RotaryAngles)
    plain = make_hf_model(tmp_path / "plain")  # control: without the key the engine forms float64 angles
    to_megatron(plain, tmp_path / "pm", progress=False)
    to_hf(tmp_path / "pm", tmp_path / "ph", progress=False)
    assert "rope_angle_precision" not in json.loads((tmp_path / "ph/config.json").read_text())
    assert isinstance(load_hf(tmp_path / "ph", device="cpu", tokenizer=tok)[0].model.rotary_emb, Float64RotaryAngles)


@pytest.mark.parametrize("variant", ["dynamic-gqa2", "longrope-gqa2"])
def test_max_position_embeddings_refused_where_rope_reads_it(variant, tmp_path, cpu_parallel_state):
    """dynamic and longrope derive frequencies from max_position_embeddings: another value is another model."""
    src = make_hf_model(tmp_path / "hf", **VARIANTS[variant])
    to_megatron(src, tmp_path / "m", progress=False)
    rope = VARIANTS[variant]["rope_scaling"]["rope_type"]
    with pytest.raises(ConvertError, match=rf"--max-position-embeddings 1024: the checkpoint's rope_type '{rope}'"):
        to_hf(tmp_path / "m", tmp_path / "h", max_position_embeddings=1024, progress=False)
    assert not (tmp_path / "h").exists()
    same = json.loads((src / "config.json").read_text())["max_position_embeddings"]  # declaring it again is fine
    to_hf(tmp_path / "m", tmp_path / "h", max_position_embeddings=same, progress=False)


def test_max_position_embeddings_pins_implicit_original_length(tmp_path, cpu_parallel_state):
    """yarn without original_max_position_embeddings: transformers takes max_position_embeddings, so the
    export writes the old value explicitly; --verify (Megatron model from the checkpoint's rope) agrees."""
    src = make_hf_model(tmp_path / "hf", rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_theta=500000.0)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["rope_parameters"]["original_max_position_embeddings"]  # transformers 5 writes it; a v4 config may not
    (src / "config.json").write_text(json.dumps(cfg))
    to_megatron(src, tmp_path / "m", progress=False)
    r = to_hf(tmp_path / "m", tmp_path / "h", max_position_embeddings=1024, verify=True, progress=False)
    out = json.loads((tmp_path / "h/config.json").read_text())
    assert out["max_position_embeddings"] == 1024
    assert out["rope_scaling"]["original_max_position_embeddings"] == 256  # TINY's max_position_embeddings
    assert r["max_abs_logit_diff"] <= TOL
    assert "rope_changed" not in r  # the same rope, only stated explicitly


def test_fp16_source_without_rms_norm_eps(tmp_path, cpu_parallel_state):
    """An fp16 model (Llama-2's releases) is stored in fp32, so the round trip is bit-exact (bf16 storage rounded
    each weight, 3.9e-3 off); a config.json without rms_norm_eps means transformers' default 1e-6 (ours was 1e-5:
    --verify failed at 9e-3), and the export states it."""
    from transformers import LlamaForCausalLM

    src = make_hf_model(tmp_path / "hf")
    LlamaForCausalLM.from_pretrained(src).half().save_pretrained(tmp_path / "fp16")
    cfg = json.loads((tmp_path / "fp16/config.json").read_text())
    del cfg["rms_norm_eps"]
    (tmp_path / "fp16/config.json").write_text(json.dumps(cfg))
    report = to_megatron(tmp_path / "fp16", tmp_path / "m", verify=True, progress=False)
    assert report["dtype"] == "float32" and report["max_abs_logit_diff"] <= TOL
    to_hf(tmp_path / "m", tmp_path / "back", verify=True, progress=False)
    a, b = read_all(tmp_path / "fp16"), read_all(tmp_path / "back")
    assert a.keys() == b.keys()
    assert all(b[k].dtype == torch.float16 and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back/config.json").read_text())["rms_norm_eps"] == 1e-6


def test_head_dim_not_hidden_over_heads(tmp_path, cpu_parallel_state):
    """head_dim set so heads x head_dim (4 x 8 = 32) != hidden (64): q/k/v project to 32, o_proj back from 32
    ([64, 32]). Every other fixture has 4 x 16 = 64, where o_proj is square. Oracle: transformers' logits."""
    src = make_hf_model(tmp_path / "hf", head_dim=8)
    assert read_all(src)["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)  # transformers' own layout
    r = to_megatron(src, tmp_path / "m", verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL
    to_hf(tmp_path / "m", tmp_path / "back", verify=True, progress=False)
    a, b = read_all(src), read_all(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back/config.json").read_text())["head_dim"] == 8


def test_stored_rotary_inv_freq_is_ignored(tmp_path, cpu_parallel_state):
    """Older transformers saved each layer's `rotary_emb.inv_freq` buffer in the checkpoint. It holds no weights (the
    rope comes from config.json), so the import drops it: same checkpoint, same logits as without it."""
    from safetensors.torch import load_file, save_file

    src = make_hf_model(tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    theta = json.loads((src / "config.json").read_text())["rope_parameters"]["rope_theta"]
    for i in range(2):  # plain RoPE's frequencies over head_dim 16, as those versions stored them
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = \
            1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = to_megatron(src, tmp_path / "m", verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL
    to_hf(tmp_path / "m", tmp_path / "back", progress=False)
    back = read_all(tmp_path / "back")
    assert not [k for k in back if "inv_freq" in k]
    assert all(torch.equal(back[k], v) for k, v in tensors.items() if "inv_freq" not in k)


# ---- pins of the mutation audit (round 5) -------------------------------------------------------

def test_vocab_divisor_is_what_pads_and_what_is_recorded(tmp_path, cpu_parallel_state):
    """make_vocab_size_divisible_by=100 pads 500 to 500 rows (128 would give 512) and is recorded, so the model
    --verify builds from the metadata loads the 500 stored rows. Oracle: transformers' logits."""
    from megatron_ext.convert.dist_reader import TorchDistReader

    src = make_hf_model(tmp_path / "hf", vocab_size=500)
    r = to_megatron(src, tmp_path / "m", make_vocab_size_divisible_by=100, verify=True, progress=False)
    assert r["max_abs_logit_diff"] <= TOL
    assert read_metadata(tmp_path / "m")["vocab"] == {"size": 500, "padded": 500, "make_vocab_size_divisible_by": 100}
    assert TorchDistReader(tmp_path / "m/iter_0000000").shape("embedding.word_embeddings.weight") == (500, 64)


def test_shard_writer_limit_numbering_and_index(tmp_path):
    """StreamingSafetensorsWriter: a shard takes tensors up to exactly max_shard_bytes (64 + 64 = 128 is one shard);
    a larger tensor gets a shard of its own; shards are named 1..n of n; the index's total_size is the tensors'
    bytes; each shard's data starts 8-byte aligned (as safetensors' own writer pads the header). Oracle: safetensors
    reads every tensor back from the shard the index names."""
    from megatron_ext.convert.hf_io import StreamingSafetensorsWriter

    tensors = {"a": torch.arange(16.0), "b": torch.arange(16.0) + 100, "c": torch.randn(40),
               "d": torch.ones(3, dtype=torch.bfloat16)}
    writer = StreamingSafetensorsWriter(tmp_path, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()],
                                        max_shard_bytes=128)
    for k, t in tensors.items():
        writer.add(k, t)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = "model-0000{}-of-00003.safetensors".format
    assert index["weight_map"] == {"a": shard(1), "b": shard(1), "c": shard(2), "d": shard(3)}
    assert index["metadata"]["total_size"] == 64 + 64 + 160 + 6
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [shard(i) for i in (1, 2, 3)]
    for name, f in index["weight_map"].items():
        with safe_open(str(tmp_path / f), framework="pt") as h:
            assert torch.equal(h.get_tensor(name), tensors[name])
    for i in (1, 2, 3):
        assert int.from_bytes((tmp_path / shard(i)).read_bytes()[:8], "little") % 8 == 0


def test_three_layers_round_trip_bit_exact(tmp_path, cpu_parallel_state):
    """Every fixture above has 2 layers, where reading layer min(i, 1) of the stack is the same as layer i: with 3,
    each exported layer must be its own. Oracle: the safetensors transformers wrote. The folder has no tokenizer: the
    metadata records none (not the folder, where no tokenizer loads from)."""
    src = make_hf_model(tmp_path / "hf", num_hidden_layers=3, tokenizer=False)
    to_megatron(src, tmp_path / "m", progress=False)
    assert read_metadata(tmp_path / "m")["tokenizer"] is None
    to_hf(tmp_path / "m", tmp_path / "back", progress=False)
    a, b = read_all(src), read_all(tmp_path / "back")
    assert a.keys() == b.keys() and "model.layers.2.mlp.down_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
