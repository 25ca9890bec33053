"""A loaded optimizer state fitted to the optimizer that runs now (megatron_ext.checkpoint's loads).

Megatron-Core steps its DistributedOptimizer with whichever Adam imports: Transformer Engine's FusedAdam (or
Apex's) where TE (or Apex) is installed, else torch's. A checkpoint keeps the param groups of the one that saved
it, and its load restores them whole: a torch-saved state resumed under FusedAdam lacked FusedAdam's group keys
(`bias_correction`: a KeyError at its first step) and kept `step` a float (its kernel takes an int). The other way
round, torch's AdamW fills its own defaults back in. The torch fallback has its own flaws after a load
(`_restore_torch_adam_steps`).
"""

from __future__ import annotations

import torch


def materialise_optimizer_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its state tensors before its sharded state dict is built.

    Without TE/Apex (CPU) its `state_dict()` reads `step` from the inner torch Adam state, which is empty
    until the first step. Megatron's own dummy-step helper fills it; the model weights and optimizer
    state it touches are all overwritten by the load that follows.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(part, DistributedOptimizer) and len(part.optimizer.state) == 0:
            part._init_optimizer_states_with_dummy_values()


def _restore_torch_adam_steps(optimizer) -> None:
    """Per-parameter Adam `step` of a DistributedOptimizer on the torch fallback (no TE/Apex) after a load.

    Megatron 0.16.1 restores `step` into the param groups, then copies the stale pre-load per-parameter
    `step` back over it (dp_reshardable path), or shares one tensor among all parameters (both paths), which
    torch Adam increments once per parameter. Give each parameter its own tensor holding the saved step.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(part, distrib_optimizer.DistributedOptimizer):
            continue
        for group in part.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = part.optimizer.state.get(p)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def complete_param_groups(inner: torch.optim.Optimizer, integer_step: bool) -> None:
    """Give every param group of `inner` the keys its class expects (`inner.defaults`, as the optimizer made them)
    where the loaded group lacks them, and an int `step` where `integer_step` (TE's and Apex's fused Adam)."""
    for group in inner.param_groups:
        for key, value in inner.defaults.items():
            group.setdefault(key, value)
        if integer_step and "step" in group:
            group["step"] = int(group["step"])


def fit_loaded_optimizer_state(optimizer) -> None:
    """After `optimizer.load_state_dict`: the groups completed for the Adam that runs now, and the torch
    fallback's per-parameter steps restored."""
    from megatron.core.optimizer import distrib_optimizer

    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(part, distrib_optimizer.DistributedOptimizer):
            complete_param_groups(part.optimizer, integer_step=distrib_optimizer.HAVE_APEX_OR_TE)
    _restore_torch_adam_steps(optimizer)
