"""Pins of megatron_ext.runtime.gpu_packages found by mutation audit round 7: a process that imported a GPU package
before the CPU path hides them is refused in words (Megatron-Core may have chosen its CUDA kernels already), and
hiding them twice (the converter at its start, the CPU backend after) is no error."""

from __future__ import annotations

import importlib
import types

import pytest

from megatron_ext.runtime.gpu_packages import hide_gpu_packages
from megatron_ext.runtime.job_env import DeviceError

# what Megatron-Core 0.16 tries to import for its GPU kernels, listed here from its sources (not from our module)
GPU_PACKAGES = ("transformer_engine", "transformer_engine_torch", "apex", "amp_C", "fused_weight_gradient_mlp_cuda")


def test_a_gpu_package_imported_before_is_refused_in_words(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "apex", types.ModuleType("apex"))
    with pytest.raises(DeviceError) as refused:
        hide_gpu_packages()
    assert str(refused.value) == (
        "runtime.device = 'cpu' in a process that has already imported apex: Megatron-Core would run its CUDA kernels "
        "on CPU tensors; run the CPU path in its own process, or use runtime.device=cuda")


def test_hiding_twice_is_no_error(monkeypatch):
    import sys

    for name in GPU_PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)  # hidden already, as after the converter's start
    hide_gpu_packages()
    with pytest.raises(ImportError):
        importlib.import_module("apex")


def test_every_gpu_package_megatron_tries_is_hidden(tmp_path):
    """Each package and compiled extension Megatron-Core 0.16 tries to import for its GPU kernels (it takes an
    ImportError for 'not installed'), installed as a stand-in that raises RuntimeError when imported, is an
    ImportError after hide_gpu_packages: the stand-in never runs (mutation audit round 9, GP1/GP2/GP6: amp_C,
    transformer_engine_torch or the last of them left importable)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    for name in GPU_PACKAGES:
        (tmp_path / f"{name}.py").write_text(f'raise RuntimeError("{name} imported")\n')
    code = ("import importlib, sys\nfrom megatron_ext.runtime.gpu_packages import hide_gpu_packages\n"
            "hide_gpu_packages()\n"
            f"for name in {GPU_PACKAGES!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except ImportError:\n        print(name, 'hidden')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert (proc.returncode, proc.stdout.split("\n")) == (0, [f"{n} hidden" for n in GPU_PACKAGES] + [""]), proc.stderr
    control = subprocess.run([sys.executable, "-c", "import amp_C"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "RuntimeError: amp_C imported" in control.stderr  # the stand-ins are found where nothing hides them


def test_every_package_imported_before_is_named(monkeypatch):
    """Two GPU packages imported before: the refusal names both, not the first only (round 9, GP5)."""
    import sys

    for name in ("transformer_engine", "amp_C"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with pytest.raises(DeviceError, match=r"has already imported transformer_engine, amp_C: Megatron-Core"):
        hide_gpu_packages()


def test_the_fallback_warnings_are_hidden_and_no_other():
    """hide_megatron_fallback_warnings (quantize.py, which runs none of Megatron's layers): Megatron-Core's two 'not
    installed. Falling back' warnings no longer show; the same text from outside megatron.core, and any other warning
    from it, still do (round 9, GP7: the filters added with action 'default', so each still showed once)."""
    import warnings

    from megatron_ext.runtime.gpu_packages import hide_megatron_fallback_warnings

    def shown(message, module):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            hide_megatron_fallback_warnings()
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module, registry={})
        return [str(w.message) for w in seen]

    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    apex = "Apex is not installed. Falling back to Torch Norm"
    assert shown(te, "megatron.core.optimizer") == shown(apex, "megatron.core.models.backends") == []
    assert shown(apex, "transformers.modeling_utils") == [apex]
    assert shown("something else", "megatron.core.optimizer") == ["something else"]
