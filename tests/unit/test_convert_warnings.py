"""tools/convert.py hides the library warnings a conversion is known to raise, which concern no conversion (Megatron-Core
on the missing Apex / Transformer Engine and its own deprecations, torch on a single-process checkpoint load and on
ShardedTensor), one by one: any other warning, also from Megatron-Core or torch.distributed, still shows. Before, every
warning of those two packages was hidden, a real problem with them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_ext import convert_cli as cli  # tools/convert.py's command line
from tests.conftest import ROOT
from tests.unit.test_convert_fixtures import make_hf_model

# As a conversion raises them (Megatron-Core 0.16.1, torch 2.13, `-W default`): (category, module, message).
RAISED = [
    (UserWarning, "megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back to Torch "
     "optimizers."),
    (UserWarning, "megatron.core.optimizer.clip_grads", "Transformer Engine and Apex are not installed. Falling back "
     "to local implementations of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale"),
    (UserWarning, "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", "Transformer Engine and Apex are "
     "not installed. Falling back to local implementations of multi_tensor_applier and multi_tensor_scale"),
    (UserWarning, "megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "megatron.core.models.gpt.gpt_layer_specs", "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "torch.distributed.checkpoint.utils", "torch.distributed is disabled, unavailable or uninitialized, "
     "assuming the intent is to load in a single process."),
    (FutureWarning, "megatron.core.dist_checkpointing.strategies.torch", "`load_state_dict` is deprecated and will be "
     "removed in future versions. Please use `load` instead."),
    (FutureWarning, "megatron_ext.runtime.cpu_backend", "Please use DTensor instead and we are deprecating "
     "ShardedTensor."),
    (DeprecationWarning, "megatron.core.tensor_parallel.layers", "Warning: tp_group is None, using default tp group. "
     "Passing tp_group will be mandatory soon"),
    (DeprecationWarning, "megatron.core.transformer.spec_utils", "MLP requires ffn_hidden_size, but it was not "
     "provided. Using                     config.ffn_hidden_size by default."),
    (DeprecationWarning, "megatron.core.transformer.multi_latent_attention", "The 'megatron.core.transformer."
     "custom_layers.transformer_engine' \n    module is deprecated and will be removed in 0.10.0. Please use \n    "
     "'megatron.core.extensions.transformer_engine' instead."),
    (DeprecationWarning, "megatron.core.inference.contexts", "The following imports from `dynamic_context.py` will be "
     "removed in this file in `megatron-core` 0.14. The imports here result in a cyclic import issue that causes "
     "rotary embeddings to import from Apex rather than Transformer Engine."),
]
# Not a conversion's: a new Megatron-Core or torch.distributed warning, or a known message from elsewhere or of
# another kind, still shows.
OTHERS = [
    (UserWarning, "megatron.core.foo", "something in the checkpoint is not what it seems"),
    (FutureWarning, "megatron.core.dist_checkpointing.strategies.torch", "`save_state_dict` is deprecated"),
    (UserWarning, "torch.distributed.checkpoint.utils", "a shard is missing"),
    (UserWarning, "transformers.modeling_utils", "Apex is not installed. Falling back to Torch Norm"),
    (RuntimeWarning, "megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "megatron_ext.convert.exporter", "torch.distributed is disabled, unavailable or uninitialized, "
     "assuming the intent is to load in a single process."),
]
# The header line Python prints for a warning: `FILE:LINE: CATEGORY: MESSAGE`
WARNING_LINE = re.compile(r"^(?P<file>\S+?):\d+: (?P<category>\w*Warning): ", re.M)


def shown(samples: list[tuple[type[Warning], str, str]], install=cli.quiet_library_warnings) -> list[str]:
    """The messages of `samples` that get through once `install` has added its filters (to a filter list that
    shows everything)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        install()
        for category, module, message in samples:
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module,
                                   registry={})
    return [str(w.message) for w in caught]


def test_the_warnings_a_conversion_raises_are_hidden():
    assert shown(RAISED) == []


def test_any_other_warning_still_shows():
    # the control: with the filters installed, each of these gets through
    assert shown(OTHERS) == [message for _, _, message in OTHERS]


@pytest.mark.parametrize("entry", cli.HARMLESS_WARNINGS, ids=lambda e: e[1][:40])
def test_each_filter_hides_a_warning_a_conversion_raises(entry):
    """No filter is dead (a regex that matches nothing hides nothing: the warning would show again)."""
    category, message, module = entry
    only = lambda: warnings.filterwarnings("ignore", message=message, category=category, module=module)  # noqa: E731
    assert len(shown(RAISED, only)) < len(RAISED)


def convert(*argv: str, pythonwarnings: str | None) -> subprocess.CompletedProcess:
    """tools/convert.py as a user runs it, under `pythonwarnings` (None: Python's default filters)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # tests/run.sh sets it to ignore
    if pythonwarnings is not None:
        env["PYTHONWARNINGS"] = pythonwarnings
    proc = subprocess.run([sys.executable, str(ROOT / "tools/convert.py"), *argv, "--verify", "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_conversion_prints_no_library_warning(tmp_path):
    src = make_hf_model(tmp_path / "hf")
    # Python's default filters: not one warning (tests/unit/test_convert_interrupt.py checks to-hf --verify alike)
    plain = convert("to-megatron", "--hf", str(src), "--out", str(tmp_path / "m"), pythonwarnings=None)
    assert "Warning" not in plain.stderr, plain.stderr
    # `default` shows the deprecations too (each once): none from Megatron-Core, torch.distributed or ours.
    # (torch.jit's own deprecation, raised as torch imports its compiler, was never hidden and still shows.)
    loud = convert("to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "back"),
                   pythonwarnings="default")
    files = [m["file"] for m in WARNING_LINE.finditer(loud.stderr)]
    assert not [f for f in files if re.search(r"/(megatron|megatron_ext|torch/distributed)/", f)], loud.stderr
    for _, _, message in RAISED:
        assert message.split("\n")[0] not in loud.stderr, loud.stderr
