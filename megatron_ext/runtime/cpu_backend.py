"""CPU backend: lets the real Megatron-Core 0.16.1 (GPTModel, schedules, DDP, optimizer,
dist_checkpointing, recompute) run on CPU with gloo.

This is the ONE module of the project that patches anything. P0-P4 and P6 are applied only for
`runtime.device: cpu`, once per process, before any model is built. Megatron-Core assumes CUDA in
places that have nothing to do with the math; each of them exists for one such assumption:

P0  Megatron-Core chooses its kernels when its modules are imported: Transformer Engine's or Apex's fused Adam,
    multi-tensor norm and final norm wherever those import, whatever the device. On the CPU path of a GPU node
    (TE installed, GPUs hidden) they ran CUDA kernels on CPU tensors. The CPU path hides those packages
    (`sys.modules[name] = None`: an import of them raises ImportError, Megatron's cue for its torch fallbacks)
    before Megatron-Core is imported: the torch fallbacks are what runs on a machine without them. It lives in
    `megatron_ext.runtime.gpu_packages`, which imports no torch, so that CPU-only tools apply it at their start
    and their --help stays fast.

P1  `torch.cuda.current_device()` is used as a device in ~175 places (tensor creation, model init);
    it returns "cpu" here. Models are built with `use_cpu_initialization=True`.
P2  The model-parallel RNG tracker seeds and swaps CUDA generator states. On CPU there is no CUDA
    generator; the tracker records seeds and `fork()` is a no-op (dropout is 0 in Llama; weights are
    initialised on CPU from one generator and then split, so TP ranks still agree).
P3  Schedules, the optimizer, `clip_grads` and CP RoPE slicing create tensors with
    `device="cuda"`, call `.cuda()` / `.pin_memory()`, and assert `grad.type() == "torch.cuda.FloatTensor"`.
    A global `TorchFunctionMode` maps cuda devices to cpu, drops pinning, makes `.cuda()` the
    identity and reports CPU tensors as `torch.cuda.*Tensor` from no-argument `Tensor.type()`.
    CUDA stream/event/synchronize/memory calls become no-ops.
P4  Activation recompute saves and restores the CUDA RNG state (`_get_cuda_rng_state`,
    `_set_cuda_rng_state`); on CPU the CPU generator state stands in.

P5 (any device; applied by `megatron_ext.checkpoint` before it loads a `fully_reshardable` optimizer state)
    Without TE or Apex, Megatron-Core's distributed optimizer steps a torch Adam, which keeps a `step`
    tensor per parameter. Loading a fully_reshardable state sets that step from the param groups, then
    copies every per-parameter state tensor from the checkpoint's, which hold no `step` (KeyError: 'step').
    The patched copy keeps the step it was just given. With TE or Apex it is not applied.

P6  Checkpoint writers report their results through a multiprocessing manager queue, which Megatron-Core starts
    with "spawn": a fresh interpreter that imports torch to unpickle the first result, 3-4 s of CPU in every
    process that saves (a two-rank test run's save took 4.4 s, 0.4 s with this). On CPU no CUDA state
    can be inherited, so the manager is forked instead (0.03 s), when the backend is applied: before any model,
    optimizer or process group exists, since a long-lived fork made later would hold a copy-on-write snapshot of
    every page training goes on to change (up to a second copy of the model and optimizer state) and the gloo
    sockets. It is started as `megatron_ext.checkpoint.start_write_results_queue` starts it, SIGTERM and SIGUSR1
    blocked. Megatron-Core forks its writer processes in any case; the queue, the writers and the files are the
    same.

Nothing here changes numerics: the same kernels run as without the patches.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.runtime.gpu_packages import hide_gpu_packages
from megatron_ext.runtime.job_env import DeviceError

_APPLIED = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _to_cpu(value: Any) -> Any:
    return "cpu" if _is_cuda(value) else value


class _CudaToCpu(TorchFunctionMode):
    """P3: cuda tensor creation and checks, answered on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.is_pinned:
            return True
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoOpStream(_NoOpEvent):
    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()


def _patch_cuda_module() -> None:
    """P1 and the no-op parts of P3."""
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.device_count = lambda: 0
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda *a, **k: None
    cuda.manual_seed = lambda *a, **k: None


def _patch_rng() -> None:
    """P2 and P4."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Records seeds like the CUDA tracker; forking keeps the CPU generator (P2)."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.tensor([seed])

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            yield

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _fork_checkpoint_results_queue() -> None:
    """P6: the checkpoint writers' results queue lives in a manager forked now, while the process is small."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_ext.checkpoint import start_write_results_queue

    def results_queue():
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    filesystem_async._get_write_results_queue = results_queue
    start_write_results_queue()


def apply_cpu_backend() -> None:
    """Apply P0-P4 and P6 (idempotent). Call before building any Megatron-Core object on CPU."""
    global _APPLIED
    if _APPLIED:
        return
    hide_gpu_packages()  # P0
    # On a machine with GPUs (a cluster node converting a checkpoint, a workstation running the demo) the CPU path
    # must see none, here and in child processes: the patches above answer CUDA questions for the CPU, and code
    # that asks torch.cuda.is_available() would send tensors to a GPU. This works while nothing in the process
    # has asked CUDA for its devices yet (the entry points of CPU-only tools also set it before importing torch).
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        if before is None:  # leave the process as it was for its CUDA work
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
        raise DeviceError("runtime.device = 'cpu' in a process that has already used CUDA: start it with "
                          "CUDA_VISIBLE_DEVICES= (empty), or use runtime.device=cuda")
    _patch_cuda_module()
    _patch_rng()
    _fork_checkpoint_results_queue()
    _CudaToCpu().__enter__()  # global for the process: never exited
    # The distributed optimizer's zero_grad asks `hasattr(param, "grad")` of its fp32 main-parameter shards, which
    # are not leaves here; torch warns at each first read (naming this module, whose mode forwards the read). A
    # read of None, no mistake: the warning only hid the run's own lines.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)
    _APPLIED = True


def keep_torch_adam_step_on_reshardable_load() -> None:
    """Apply P5 (idempotent; nothing to do when TE or Apex provides the optimizer)."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or getattr(cls, "_megatron_ext_p5", False):
        return
    set_states = cls._set_main_param_and_optimizer_states

    def set_states_keeping_step(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        set_states(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states_keeping_step
    cls._megatron_ext_p5 = True


def cpu_backend_applied() -> bool:
    return _APPLIED
