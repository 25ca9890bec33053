"""Pins of megatron_ext.runtime.gpu_packages found by mutation audit round 7: a process that imported a GPU package
before the CPU path hides them is refused in words (Megatron-Core may have chosen its CUDA kernels already), and
hiding them twice (the converter at its start, the CPU backend after) is no error."""

from __future__ import annotations

import importlib
import types

import pytest

from megatron_ext.runtime.gpu_packages import hide_gpu_packages
from megatron_ext.runtime.job_env import DeviceError


def test_a_gpu_package_imported_before_is_refused_in_words(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "apex", types.ModuleType("apex"))
    with pytest.raises(DeviceError) as refused:
        hide_gpu_packages()
    assert str(refused.value) == (
        "runtime.device = 'cpu' in a process that has already imported apex: Megatron-Core would run its CUDA kernels "
        "on CPU tensors; run the CPU path in its own process, or use runtime.device=cuda")


def test_hiding_twice_is_no_error(monkeypatch):
    import sys

    for name in ("transformer_engine", "transformer_engine_torch", "apex", "amp_C", "fused_weight_gradient_mlp_cuda"):
        monkeypatch.setitem(sys.modules, name, None)  # hidden already, as after the converter's start
    hide_gpu_packages()
    with pytest.raises(ImportError):
        importlib.import_module("apex")
