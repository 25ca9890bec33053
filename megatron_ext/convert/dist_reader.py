"""Read single tensors, or one layer of a stacked tensor, from a torch_dist checkpoint without a model.

`dist_checkpointing.load_plain_tensors` reads every tensor of a checkpoint at once (16 GB for an 8B
model in bf16). For streaming export we read one layer's slice at a time straight from
torch.distributed.checkpoint: a load planner whose destination is a chunk of the global tensor.
The checkpoint stores global tensors, so this works whatever TP/PP it was saved at.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ext.checkpoint_damage import damaged_shard_error, failed_reads
from megatron_ext.checkpoint_index import check_complete, read_dcp_index
from megatron_ext.runtime.signals import interrupts_unwrapped


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose index is read with an allow-list (`read_dcp_index`); tensor data is read with
    `torch.load(weights_only=True)` by torch itself."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_index(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads, for each key, the chunk (offsets, sizes) of the global tensor into a local tensor."""

    def __init__(self, chunks: dict[str, ChunkStorageMetadata]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, chunk in self.chunks.items():
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # read items carry offsets relative to our chunk


class TorchDistReader:
    """Global shapes/dtypes of a torch_dist checkpoint's tensors, and reads of whole tensors or layer slices."""

    def __init__(self, path: str | Path):
        from megatron_ext.checkpoint import CheckpointError
        from megatron_ext.convert.hf_io import ConvertError

        self.path = Path(path)
        self._reader = _SafeReader(str(self.path))
        try:
            check_complete(self.path)
            meta = self._reader.read_metadata()
        except CheckpointError as e:
            raise ConvertError(str(e)) from None
        self._index = meta
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    @interrupts_unwrapped()  # Ctrl-C / SIGTERM mid-read: the interrupt, not torch's CheckpointException wrapping it
    def read(self, keys: list[str], layer: int | None = None) -> dict[str, torch.Tensor]:
        """Tensors of `keys`; with `layer`, only slice `layer` of their leading (stacked layer) axis."""
        state, chunks = {}, {}
        for key in keys:
            size = self.shape(key)
            if layer is None:
                offsets, local = (0,) * len(size), size
            else:
                offsets, local = (layer,) + (0,) * (len(size) - 1), (1,) + size[1:]
            state[key] = torch.empty(local, dtype=self.dtype(key))
            chunks[key] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local))
        try:
            dcp.load(state, storage_reader=self._reader, planner=_ChunkLoadPlanner(chunks), no_dist=True)
        except CheckpointException as e:  # a damaged shard fails inside torch, named nowhere: find it
            error = damaged_shard_error(self.path, self._index, set(keys)) if failed_reads(e) else None
            if error is None:
                raise
            from megatron_ext.convert.hf_io import ConvertError

            raise ConvertError(str(error)) from None
        return {k: (v[0] if layer is not None else v) for k, v in state.items()}
