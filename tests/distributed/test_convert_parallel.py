"""A converted checkpoint at TP=2 (2 gloo processes): same loss and logits as TP=1 and as transformers.

Checkpoints re-saved at TP=2 and at PP=2 export back to the original HF tensors bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext.convert import to_hf, to_megatron
from tests.conftest import ROOT, read_json
from tests.unit.test_convert_fixtures import make_hf_model
from tests.unit.test_convert_roundtrip import read_all

WORKER = ROOT / "tests/distributed/workers/convert_parallel.py"


@pytest.fixture(scope="module")
def work(tmp_path_factory, cpu_parallel_state, torchrun):
    d = tmp_path_factory.mktemp("convert_tp")
    src = make_hf_model(d / "hf", vocab_size=500)  # padded to 512 rows, stripped on export
    to_megatron(src, d / "mcore", progress=False)
    torchrun(WORKER, 2, "--root", str(d / "mcore"), "--tp", "2", "--out", str(d / "tp2.json"),
             "--logits", str(d / "tp2.safetensors"), "--save", str(d / "resaved_tp2"))
    return src, d


def test_tp2_equals_tp1_and_transformers(work, cpu_parallel_state):
    from tests.distributed.workers.convert_parallel import loss_and_logits, tokens_for

    from megatron_ext.checkpoint import load_checkpoint
    from megatron_ext.convert.verify import hf_logits
    from megatron_ext.model import BuildOptions, build_model

    src, d = work
    cfg = json.loads((src / "config.json").read_text())
    tp1 = build_model(cfg, BuildOptions(device="cpu", precision="fp32", seq_length=48))
    load_checkpoint(d / "mcore", [tp1], weights_only=True)
    tokens, labels = tokens_for(cfg["vocab_size"])
    loss1, logits1 = loss_and_logits(tp1, tokens, labels, cfg["vocab_size"])
    loss2, logits2 = read_json(d / "tp2.json")["loss"], load_file(str(d / "tp2.safetensors"))["logits"]
    assert abs(loss1 - loss2) < 1e-5, (loss1, loss2)
    assert (logits1 - logits2).abs().max().item() < 1e-5
    assert (hf_logits(src, tokens) - logits2).abs().max().item() < 1e-4  # the outside oracle
    assert 5.0 < loss2 < 7.5  # ~ln(512) for a random model: the check compares real numbers


def test_resaved_at_tp2_and_pp2_export_bit_exact(work, torchrun, cpu_parallel_state):
    from megatron.core import dist_checkpointing

    src, d = work
    torchrun(WORKER, 2, "--root", str(d / "mcore"), "--pp", "2", "--save", str(d / "resaved_pp2"))
    original = dist_checkpointing.load_plain_tensors(str(d / "mcore/iter_0000000"))
    ref = read_all(src)
    for name in ("resaved_tp2", "resaved_pp2"):
        plain = dist_checkpointing.load_plain_tensors(str(d / name / "iter_0000005"))
        for k, v in original.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(plain[k], v), (name, k)
        to_hf(d / name, d / f"{name}_hf", progress=False)
        back = read_all(d / f"{name}_hf")
        assert sorted(back) == sorted(ref)
        assert all(torch.equal(back[k], ref[k]) for k in ref), name
        assert back["model.embed_tokens.weight"].shape == (500, 64)


def test_converted_tensors_are_stored_in_tp_pieces(work):
    """Each TP-split tensor is stored in pieces along its TP axis (fc1: each SwiGLU half), so a rank at TP 2 reads its
    own pieces; stored whole, every rank read the whole tensor to keep half of it (at TP 8, 12x the bytes)."""
    from megatron_ext.checkpoint_index import read_dcp_index
    from megatron_ext.convert.importer import tp_piece_count

    _, d = work
    cfg = read_json(d / "hf/config.json")
    pieces = tp_piece_count(cfg)
    assert pieces == 2  # the fixture's 2 KV heads
    index = read_dcp_index(d / "mcore/iter_0000000")
    chunks = {key: len(meta.chunks) for key, meta in index.state_dict_metadata.items() if hasattr(meta, "chunks")}
    layers = cfg["num_hidden_layers"]
    assert chunks["decoder.layers.self_attention.linear_qkv.weight"] == layers * pieces
    assert chunks["decoder.layers.self_attention.linear_proj.weight"] == layers * pieces
    assert chunks["decoder.layers.mlp.linear_fc1.weight"] == layers * 2 * pieces
    assert chunks["decoder.layers.mlp.linear_fc2.weight"] == layers * pieces
    assert chunks["embedding.word_embeddings.weight"] == pieces
    assert chunks["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == layers  # replicated: whole
    qkv = index.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    rows = sorted({c.offsets[1] for c in qkv.chunks})  # [layer, rows, hidden]: split along the rows
    assert len(rows) == pieces and rows[1] == qkv.size[1] // pieces
    fc2 = index.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"]
    assert sorted({c.offsets[2] for c in fc2.chunks}) == [0, fc2.size[2] // pieces]  # along its input axis
    # linear_proj is a RowParallelLinear as fc2: split along its input axis (the heads), not its output rows
    proj = index.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"]
    assert sorted({c.offsets[2] for c in proj.chunks}) == [0, proj.size[2] // pieces]
    assert {c.offsets[1] for c in proj.chunks} == {0}
    assert tp_piece_count({"num_key_value_heads": 8, "intermediate_size": 14336}) == 8  # Llama-3.1-8B
    assert tp_piece_count({"num_key_value_heads": 8, "intermediate_size": 14340}) == 4
    # a vocabulary padded to a multiple of 4 only (make_vocab_size_divisible_by=4): equal pieces, fewer of them
    from megatron_ext.convert.importer import tp_pieces
    from megatron_ext.convert.mapping import TABLE

    embedding = next(e for e in TABLE if e.megatron == "embedding.word_embeddings.weight")
    split = tp_pieces(embedding, torch.zeros(32004, 2), 8, 0)
    assert [p.shape[0] for p, _ in split] == [8001] * 4 and [o for _, o in split][-1] == ((0, 3, 4),)
