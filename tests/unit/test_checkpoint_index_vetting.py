"""read_dcp_index vets a torch_dist `.metadata` pickle without changing the process: a crafted file that sets
state (BUILD) on an allow-listed class, function or shared singleton is refused and leaves it as it was; a real
index reads as torch reads it, and a damaged one is one CheckpointError."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
import torch.serialization
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType

from megatron_ext.checkpoint import save_checkpoint
from megatron_ext.checkpoint_index import CheckpointError, _Stub, read_dcp_index
from megatron_ext.model import BuildOptions, build_model
from megatron_ext.presets import TINY


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _dict(**items: int) -> bytes:  # MARK, str keys, int values, DICT
    return b"(" + b"".join(f"V{k}\nI{v}\n".encode() for k, v in items.items()) + b"d"


_META = _global("torch.distributed.checkpoint.metadata", "Metadata")
CRAFTED = {
    # the audit's: slot state (setattr) on an allow-listed class ...
    "class, slot state": _META + b"(N" + _dict(planted=1) + b"tb.",
    "class, dict state": _META + _dict(planted=1) + b"b.",
    # ... and a dict on a function's __dict__: _get_layout's cache, which every later torch.load reads
    "function": _global("torch.serialization", "_get_layout") + b"(Vcache\n" + _dict(**{"torch.strided": 42}) + b"db.",
    # an enum member that an allowed call returns is shared process-wide: its value
    "enum member": _global("torch.distributed.checkpoint.planner", "WriteItemType") + b"(I1\ntR"
                   + _dict(_value_=99, planted=1) + b"b.",
    "dtype singleton": _global("torch", "float32") + _dict(planted=1) + b"b.",
    # a new record may take state, but not a dunder (an instance __setstate__ runs on the next BUILD)
    "dunder on a record": _global("torch.distributed.checkpoint.metadata", "MetadataIndex") + b")\x81(V__setstate__\n"
                          + _global("builtins", "set") + b"db.",
}


def _process_state() -> dict:
    """What a crafted index could change: the allow-listed class, function, enum member and our stub class."""
    return {"Metadata": dict(vars(Metadata)), "_get_layout": {k: dict(v) if isinstance(v, dict) else v for k, v in
                                                               vars(torch.serialization._get_layout).items()},
            "WriteItemType(1)": dict(vars(WriteItemType(1))), "_Stub": dict(vars(_Stub))}


@pytest.mark.parametrize("stubs", [False, True], ids=["torch classes", "stubs"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_index_is_refused_and_changes_nothing(case, stubs, tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + CRAFTED[case])
    before = _process_state()
    if stubs and case == "enum member":  # a stub enum member is a new object: it may take state, harmlessly
        read_dcp_index(tmp_path, stubs=True)
    else:
        with pytest.raises(CheckpointError, match="refusing|not a readable torch_dist checkpoint index"):
            read_dcp_index(tmp_path, stubs=stubs)
    assert _process_state() == before
    assert not hasattr(Metadata, "planted") and not hasattr(_Stub, "planted") and not hasattr(_Stub, "cache")
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert WriteItemType(1).value == 1 and WriteItemType(1) is WriteItemType.TENSOR


def test_refusal_names_the_target(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + CRAFTED["function"])
    with pytest.raises(CheckpointError, match="refusing BUILD on function torch.serialization._get_layout"):
        read_dcp_index(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + CRAFTED["enum member"])
    with pytest.raises(CheckpointError, match="refusing BUILD on a WriteItemType object"):
        read_dcp_index(tmp_path)


def _saved_index(root) -> bytes:
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    return (save_checkpoint(root, 1, [model], metadata={"hf_config": TINY}) / ".metadata").read_bytes()


def test_real_index_reads_as_torch_reads_it(tmp_path, cpu_parallel_state):
    raw = _saved_index(tmp_path / "ckpt")
    path = tmp_path / "ckpt/iter_0000001"
    before = _process_state()
    index, theirs = read_dcp_index(path), pickle.loads(raw)  # what torch's FileSystemReader.read_metadata does
    assert type(index) is Metadata and index == theirs and index.storage_data
    stubbed = read_dcp_index(path, stubs=True)
    assert {k.fqn: (v.relative_path, v.offset, v.length) for k, v in stubbed.storage_data.items()} == \
        {k.fqn: (v.relative_path, v.offset, v.length) for k, v in theirs.storage_data.items()}
    assert _process_state() == before


def test_damaged_index_is_one_error(tmp_path, cpu_parallel_state):
    """Random byte changes and cuts of a real index: a CheckpointError or a read, nothing else, nothing changed."""
    good = _saved_index(tmp_path / "ckpt")
    rng, before, refused = random.Random(0), _process_state(), 0
    for trial in range(300):
        data = bytearray(good)
        if trial % 4 == 0:
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(2, len(data))] = rng.randrange(256)
        (tmp_path / ".metadata").write_bytes(bytes(data))
        for stubs in (False, True):
            try:
                read_dcp_index(tmp_path, stubs=stubs)
            except CheckpointError:
                refused += 1
    assert _process_state() == before
    assert refused > 150  # most damage is caught (a changed digit in a number reads)
