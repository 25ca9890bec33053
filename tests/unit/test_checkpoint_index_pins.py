"""checkpoint_index pins from the mutation audit: the completeness check against torch's own index, and the
architecture field a misfit names."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from megatron_ext.checkpoint import save_checkpoint
from megatron_ext.checkpoint_index import CheckpointError, _architecture_mismatch, check_complete, read_dcp_index
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY


@pytest.mark.parametrize("order", ["as saved", "reversed"])
def test_a_shard_one_byte_short_is_incomplete(tmp_path, cpu_parallel_state, order):
    """Each shard must reach the end of its last item, offset + length as torch's FileSystemReader reads the index
    (the largest over the file's items, whatever their order: torch writes them in file order, but its index is a
    dict that promises none; "reversed" is the same index, its entries listed the other way): one byte less is
    named, the full size passes."""
    from torch.distributed.checkpoint import FileSystemReader

    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    path = save_checkpoint(tmp_path / "ckpt", 1, [model], metadata={"hf_config": TINY})
    if order == "reversed":
        index = pickle.loads((path / ".metadata").read_bytes())
        index.storage_data = dict(reversed(list(index.storage_data.items())))
        (path / ".metadata").write_bytes(pickle.dumps(index))
    ends: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    assert len(ends) >= 2
    for name, end in ends.items():
        whole = (path / name).read_bytes()
        (path / name).write_bytes(whole[:end])
        check_complete(path)
        (path / name).write_bytes(whole[:end - 1])
        with pytest.raises(CheckpointError, match=f"incomplete checkpoint: {name} has {end - 1} bytes, the index "
                                                  f"needs {end}"):
            check_complete(path)
        (path / name).write_bytes(whole)


def test_architecture_mismatch_names_head_dim():
    """head_dim (Megatron's kv_channels) alone differing is named: the projections' shapes differ, and the error
    should say which architecture field made them."""
    hf = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 512}
    config = SimpleNamespace(hidden_size=256, ffn_hidden_size=512, num_layers=2, num_attention_heads=4,
                             num_query_groups=2, kv_channels=64)
    assert _architecture_mismatch({"hf_config": hf}, config) == "head_dim: checkpoint 128, model 64"
    assert _architecture_mismatch({"hf_config": {**hf, "head_dim": 64}}, config) is None


def test_an_index_that_holds_no_metadata_is_refused(tmp_path):
    """A `.metadata` that unpickles to something other than torch's Metadata (here a plain dict, which the
    allow-list lets through) is refused by name; taken as an index without storage entries it passed the
    completeness check, and torch failed later inside its load."""
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"storage_data": {}}))
    for name in ("common.pt", "metadata.json"):
        (tmp_path / name).write_bytes(b"x")
    for stubs in (False, True):
        with pytest.raises(CheckpointError, match=r"not a torch_dist checkpoint index \(it holds a dict, not a "
                                                  r"Metadata\)"):
            read_dcp_index(tmp_path, stubs=stubs)
    with pytest.raises(CheckpointError, match="it holds a dict"):
        check_complete(tmp_path)
