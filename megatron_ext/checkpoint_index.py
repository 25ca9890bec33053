"""What a checkpoint directory holds, read without trusting it: the torch_dist index (allow-listed
unpickling), whether a model's tensors fit the stored ones, with one error that says why not, and
whether a run's layout can take the stored optimizer state.

The vetting covers the `.metadata` file as it was when we read it: Megatron-Core's load then opens and plainly
unpickles it again (torch's FileSystemReader.read_metadata, through its torch_dist load strategy), so a
checkpoint folder must not be written by anyone else while it loads: a `.metadata` swapped in between the two
reads is unpickled unvetted (routing that read through `read_dcp_index` would mean patching Megatron-Core's
`_get_filesystem_reader` or re-implementing its load strategy).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path

METADATA_FILE = "megatron_ext.json"  # our run metadata beside the torch_dist files (megatron_ext.checkpoint)


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the model (one clear message)."""


def _architecture_mismatch(meta: dict, config) -> str | None:
    """First architecture field where the checkpoint's HF config and the model's TransformerConfig differ."""
    from megatron_ext.hf_config import normalize_hf_config

    hf = meta.get("hf_config")
    if not hf:
        return None
    hf = normalize_hf_config(hf)
    pairs = [("hidden_size", "hidden_size"), ("intermediate_size", "ffn_hidden_size"),
             ("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_attention_heads"),
             ("num_key_value_heads", "num_query_groups"), ("head_dim", "kv_channels")]
    for hf_name, mc_name in pairs:
        if hf.get(hf_name) != getattr(config, mc_name, None):
            return f"{hf_name}: checkpoint {hf.get(hf_name)}, model {getattr(config, mc_name, None)}"
    return None


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


class _Stub:
    """An allow-listed torch class of the index, read without importing torch (~4 s): its pickled state as
    attributes. `check_complete` needs only the storage entries' relative_path, offset and length."""

    def __init__(self, *args) -> None:  # torch.Size((...)), an enum member, a layout by name
        self.args = args

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (__dict__, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _what(obj) -> str:
    """What an object on the unpickler's stack is, for a refusal."""
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{type(obj).__name__} {getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return "nothing" if obj is None else f"a {type(obj).__qualname__} object"


_Plain = pickle._Unpickler  # the pure-Python unpickler


class _IndexUnpickler(_Plain):
    """Unpickles a torch_dist `.metadata` file, allowing only the classes such files contain, and only the
    opcodes that build new data from them.

    torch.distributed.checkpoint stores its index as a pickle and reads it with plain `pickle.load`,
    which would run code from a crafted file. Checkpoints come from elsewhere, so we allow-list.
    `stubs`: torch's classes become `_Stub`s (same allow-list; torch is not imported).

    An allow-list of names is not enough: BUILD sets state (`__dict__.update`, setattr) on whatever is on the
    stack, and a crafted file can put an allow-listed class or function there (`Metadata`, `_get_layout`, whose
    `cache` every torch.load uses), or a process-wide singleton that an allowed call returns (an enum member of
    `WriteItemType(1)`: its `_value_`). So this is the pure-Python unpickler (the C one cannot be told which
    opcodes to run) with its dispatch table narrowed: BUILD only on an instance of the index's own record
    classes (new objects NEWOBJ made, never shared), with plain attribute names; REDUCE, NEWOBJ and OBJ only
    call what `find_class` gave; SETITEM(S), APPEND(S) and ADDITEMS only fill dicts, lists and sets the
    file made. Cost: 2.5-5 MB/s, 3-12x the C unpickler's time (measured on a 2-core CPU: tiny-model index, 22 KB,
    5 ms; 32 layers with the optimizer, 258 KB, 60 ms; 10^5 chunks, 14 MB, 5-6 s against 1.3-1.8 s).
    """

    # Exact (module, name) pairs: what torch 2.x's torch_dist indexes hold. Not "any name of a module": pickle
    # resolves a dotted name attribute by attribute (torch.distributed.checkpoint.filesystem + "os.system").
    _RECORDS = {("torch.distributed.checkpoint.metadata", n) for n in (  # dataclasses: new instances take state
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata")} | {
        ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    _DCP = _RECORDS | {("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # enums: members shared
                       ("torch.distributed.checkpoint.planner", "WriteItemType")}
    _TORCH = {("torch", n) for n in ("Size", "strided", "contiguous_format", "preserve_format", "channels_last",
                                      "device", "float32", "float16", "bfloat16", "float64", "int64", "int32",
                                      "int16", "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")}
    _OTHER = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
              ("builtins", "slice"),
              ("torch.serialization", "_get_layout")}  # looks a layout up by name in torch
    ALLOWED = _DCP | _TORCH | _OTHER

    def __init__(self, file, stubs: bool = False) -> None:
        super().__init__(file)
        self.stubs = stubs
        self._given: dict[int, object] = {}  # id -> what find_class returned (held, so ids stay unique)
        self._records: set = {_Stub} if stubs else set()

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        obj = _Stub if self.stubs and module.split(".")[0] == "torch" else super().find_class(module, name)
        self._given[id(obj)] = obj
        if (module, name) in self._RECORDS:
            self._records.add(obj)
        return obj

    def _callable(self, func, opcode: str, need_type: bool = False) -> None:
        if self._given.get(id(func)) is not func or (need_type and not isinstance(func, type)):
            raise pickle.UnpicklingError(f"refusing {opcode} on {_what(func)} in checkpoint metadata")

    @staticmethod
    def _target(obj, types: tuple, opcode: str) -> None:
        if type(obj) not in types:
            raise pickle.UnpicklingError(f"refusing {opcode} on {_what(obj)} in checkpoint metadata")

    def _mark_target(self):  # the object below the topmost MARK (what SETITEMS, APPENDS, ADDITEMS fill)
        if not self.metastack or not self.metastack[-1]:
            raise pickle.UnpicklingError("malformed pickle: no object below MARK")
        return self.metastack[-1][-1]

    def _build(self) -> None:
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("malformed pickle: BUILD on an empty stack")
        inst, state = self.stack[-2], self.stack[-1]
        if type(inst) not in self._records:
            raise pickle.UnpicklingError(f"refusing BUILD on {_what(inst)} in checkpoint metadata (only the "
                                         "index's own records take state)")
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            for key in part if isinstance(part, dict) else ():
                if type(key) is not str or key.startswith("__"):
                    raise pickle.UnpicklingError(f"refusing BUILD of attribute {key!r} on {_what(inst)} in "
                                                 "checkpoint metadata")
        _Plain.load_build(self)

    # Opcodes that act on an object already on the stack: each checks it, then runs the plain handler.
    def _reduce(self) -> None:
        self._callable(self.stack[-2] if len(self.stack) > 1 else None, "REDUCE")
        _Plain.load_reduce(self)

    def _newobj(self) -> None:
        self._callable(self.stack[-2] if len(self.stack) > 1 else None, "NEWOBJ", need_type=True)
        _Plain.load_newobj(self)

    def _newobj_ex(self) -> None:
        self._callable(self.stack[-3] if len(self.stack) > 2 else None, "NEWOBJ_EX", need_type=True)
        _Plain.load_newobj_ex(self)

    def _obj(self) -> None:  # (INST: find_class vets its class)
        self._callable(self.stack[0] if self.stack else None, "OBJ")
        _Plain.load_obj(self)

    # The containers these fill are ones the file made (EMPTY_DICT, LIST, ...): nothing allowed returns a shared one.
    def _setitem(self) -> None:
        self._target(self.stack[-3] if len(self.stack) > 2 else None, (dict, OrderedDict), "SETITEM")
        _Plain.load_setitem(self)

    def _setitems(self) -> None:
        self._target(self._mark_target(), (dict, OrderedDict), "SETITEMS")
        _Plain.load_setitems(self)

    def _append(self) -> None:
        self._target(self.stack[-2] if len(self.stack) > 1 else None, (list,), "APPEND")
        _Plain.load_append(self)

    def _appends(self) -> None:
        self._target(self._mark_target(), (list,), "APPENDS")
        _Plain.load_appends(self)

    def _additems(self) -> None:
        self._target(self._mark_target(), (set,), "ADDITEMS")
        _Plain.load_additems(self)

    dispatch = {**_Plain.dispatch, **{op[0]: handler for op, handler in (
        (pickle.BUILD, _build), (pickle.REDUCE, _reduce), (pickle.NEWOBJ, _newobj), (pickle.NEWOBJ_EX, _newobj_ex),
        (pickle.OBJ, _obj), (pickle.SETITEM, _setitem), (pickle.SETITEMS, _setitems), (pickle.APPEND, _append),
        (pickle.APPENDS, _appends), (pickle.ADDITEMS, _additems))}}


def read_dcp_index(path: str | Path, stubs: bool = False):
    """The torch.distributed.checkpoint index (`.metadata`) of a checkpoint directory, read with an allow-list.

    Raises CheckpointError for a missing, corrupt or crafted file, leaving the process's classes and functions
    as they were. `load_checkpoint` reads the index this way first, so the plain `pickle.load` that torch then
    does runs only on a vetted file. `stubs`: without importing torch, torch's classes as `_Stub`s (for reading
    its entries' fields only).
    """
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:  # read whole: a FRAME's length is the file's to claim, not an allocation's
            index = _IndexUnpickler(io.BytesIO(f.read()), stubs).load()
    except Exception as e:  # noqa: BLE001: any failure to read an untrusted file (torch.device('x'): RuntimeError)
        raise CheckpointError(f"{file}: not a readable torch_dist checkpoint index ({type(e).__name__}: {e})") \
            from None
    if type(index).__name__ not in ("Metadata", "_Stub"):
        raise CheckpointError(f"{file}: not a torch_dist checkpoint index (it holds a {type(index).__name__}, not "
                              "a Metadata)")
    return index


def check_complete(path: str | Path, index=None) -> None:
    """Raise one CheckpointError when a file that the torch_dist index of `path` refers to is missing or
    shorter than the index says: a save that did not finish on some node, or a partial copy. `index`: the index
    already read (`read_dcp_index`), else it is read here (stubs: no torch import)."""
    path = Path(path)
    index = read_dcp_index(path, stubs=True) if index is None else index
    needed: dict[str, int] = {"common.pt": 1, "metadata.json": 1}  # Megatron's own files beside the index
    for info in (getattr(index, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        try:  # open, not stat: NFS revalidates a file's size written by another node on open
            with open(path / name, "rb") as f:
                have = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror})")
            continue
        if have < size:
            problems.append(f"{name} has {have} bytes, the index needs {size}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{path}: incomplete checkpoint: {'; '.join(problems[:3])}{more}. A save that did not "
                              "finish or a partial copy: copy it again, or point latest_checkpointed_iteration.txt "
                              "at an earlier iter_* folder")


def check_fits(path: Path, model_state: dict, model_chunks: list, index) -> dict:
    """Raise one CheckpointError when the model's tensors are missing from, or shaped unlike, the checkpoint; else
    return what it stores (Megatron-Core's tensors metadata: key -> ShardedTensor without data). `index`: the
    checkpoint's `read_dcp_index`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    try:
        stored = TorchDistLoadShardedStrategy().load_tensors_metadata(Path(path), index)
    except Exception as e:  # CheckpointingException, OSError, torch errors on corrupt files
        raise CheckpointError(f"{path}: cannot read the torch_dist metadata ({type(e).__name__}: {e})") from None
    problems = []
    vocab_rows = False
    for sh in nested_values(model_state):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in stored:
            problems.append(f"missing {sh.key}")
        elif tuple(stored[sh.key].global_shape) != tuple(sh.global_shape):
            problems.append(f"{sh.key}: checkpoint {tuple(stored[sh.key].global_shape)}, "
                            f"model {tuple(sh.global_shape)}")
            if sh.key in _VOCAB_KEYS and tuple(stored[sh.key].global_shape)[1:] == tuple(sh.global_shape)[1:]:
                vocab_rows = True
    if problems:
        try:
            saved = json.loads((path / METADATA_FILE).read_text())
        except (OSError, ValueError):  # a corrupt or missing run metadata: the shapes say what differs
            saved = {}
        arch = _architecture_mismatch(saved, model_chunks[0].config)
        why = f" (architecture differs, {arch})" if arch else ""
        if not arch and vocab_rows:
            why = (" (padded vocabulary rows differ: padding is vocab_size rounded up to "
                   "a multiple of both make_vocab_size_divisible_by and TP, so this TP or divisor pads differently; use the "
                   "make_vocab_size_divisible_by and a TP that give the checkpoint's row count)")
        shown = "; ".join(sorted(set(problems))[:4]) + (f"; ... {len(problems) - 4} more" if len(problems) > 4 else "")
        raise CheckpointError(f"checkpoint {path} does not fit the model{why}: {shown}; "
                              "build the model from the checkpoint's hf_config (read_metadata) or pick another checkpoint")
    return stored


def gradient_bucket_size(overlap_grad_reduce: bool, ddp_bucket_size: int | None, data_parallel: int) -> int | None:
    """Parameters per gradient bucket as Megatron-Core's DDP sets them (None: all in one bucket).

    Without overlap there is one bucket; with it, `train.ddp_bucket_size` or max(40M, 1M x DP) (DP without CP).
    """
    if not overlap_grad_reduce:
        return None
    return ddp_bucket_size if ddp_bucket_size is not None else max(40_000_000, 1_000_000 * data_parallel)


def saved_bucket_size(saved: dict) -> int | None:
    """`gradient_bucket_size` of the run that wrote a checkpoint, from its run metadata (`read_metadata`; runs from
    before these recipe fields had one bucket)."""
    train = (saved.get("recipe") or {}).get("train") or {}
    return gradient_bucket_size(bool(train.get("overlap_grad_reduce")), train.get("ddp_bucket_size"),
                                (saved.get("parallel") or {}).get("data", 1))


def saved_fully_reshardable(saved: dict) -> bool:
    """Whether a checkpoint's distributed optimizer state was saved `fully_reshardable` (keyed by parameter, loads
    at any layout), from its run metadata; checkpoints from before `checkpoint.optimizer_sharding` are not."""
    return saved.get("optimizer_sharding", "dp_reshardable") == "fully_reshardable"


def _buckets(size: int | None) -> str:
    return "one bucket" if size is None else f"buckets of {size:,} parameters"


def optimizer_state_mismatch(saved: dict, layout: dict[str, int], distributed_optimizer: bool,
                             precision: str | None = None, bucket_size: int | None = None) -> str | None:
    """Why a run with parallel `layout` cannot load the optimizer state of a checkpoint whose run metadata is
    `saved` (`read_metadata`), or None when it can. `bucket_size`: the run's `gradient_bucket_size`.

    The distributed optimizer keeps flat fp32 buffers, one per bucket of a TP x PP rank's parameters, cut
    into DP x CP slices; saved `dp_reshardable` (megatron_ext.checkpoint), they load at any DP x CP but not
    at another TP or PP, or with other buckets (train.overlap_grad_reduce, train.ddp_bucket_size), which hold
    other parameters. Saved `fully_reshardable` (checkpoint.optimizer_sharding), they are gathered into the
    parameters' shapes, and the plain optimizer's state follows each parameter's own sharding: any layout
    loads those. The state is keyed by the parameters' dtype (bf16 runs keep fp32 master weights, fp32 runs
    none), so another `train.precision` cannot load it either.
    """
    if saved.get("has_optimizer") is False:
        return "the checkpoint holds no optimizer state"
    saved_layout = saved.get("parallel")
    saved_distributed = ((saved.get("recipe") or {}).get("train") or {}).get("distributed_optimizer")
    if not saved_layout or saved_distributed is None:
        return "the checkpoint does not record its parallel layout and optimizer"
    if saved_distributed != distributed_optimizer:
        return f"train.distributed_optimizer was {saved_distributed}, now {distributed_optimizer}"
    saved_precision = ((saved.get("recipe") or {}).get("train") or {}).get("precision")
    if precision is not None and saved_precision is not None and saved_precision != precision:
        return f"train.precision was {saved_precision}, now {precision}"
    if distributed_optimizer and not saved_fully_reshardable(saved):
        changed = [f"parallel.{k} {saved_layout.get(k)} -> {layout[k]}" for k in ("tensor", "pipeline")
                   if saved_layout.get(k) != layout[k]]
        if changed:
            return ("the distributed optimizer's state is cut along TP x PP buckets and cannot follow "
                    + ", ".join(changed) + " (DP and CP may change; to keep it, re-save it once with "
                    "`tools/checkpoint.py reshard`, and save with checkpoint.optimizer_sharding=fully_reshardable)")
        saved_buckets = saved_bucket_size(saved)
        if saved_buckets != bucket_size:
            return (f"the distributed optimizer's state is cut along its gradient buckets: {_buckets(saved_buckets)}"
                    f" when saved, {_buckets(bucket_size)} now (train.overlap_grad_reduce, train.ddp_bucket_size; "
                    "set them as saved to keep the state, or re-save it once with `tools/checkpoint.py reshard`)")
    return None
