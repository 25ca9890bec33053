"""Pins of the evaluation plan (megatron_ext.eval_plan, `tools/plan.py --eval`) from mutation audit round 8: the
K/V a context-parallel ring holds per kernel backend, no ring without CP, a layout of zero GPUs refused in one line,
the replica arguments of the NIAH pass count, and the fit at exactly the GPU's capacity. All by hand, no model."""

from __future__ import annotations

import pytest

from megatron_ext.cost_model import GB, GPU, GPUS, Shape
from megatron_ext.eval_plan import EvalMemory, EvalPlan, eval_plan, layer_working_set_bytes, niah_pass_flops
from megatron_ext.recipe import RecipeError

# attention outweighs the MLP here (h 64, ffn 64, 8 heads and 8 KV heads of 8), so the ring shows in the result
ATTENTION_HEAVY = Shape(2, 64, 64, 8, 8, 8, 512)


def _attention_phase(tokens: float) -> float:
    """The attention phase's activations on `tokens` tokens of ATTENTION_HEAVY at TP 1, bf16 (by hand: residual, norm
    and projection output 3h, Q/K/V (8 + 16) x 8, rotated Q and K 16 x 8, core output 8 x 8)."""
    return tokens * 2 * (3 * 64 + (8 + 16) * 8 + 16 * 8 + 64)


def _kv(tokens: float) -> float:
    """K and V of `tokens` tokens of ATTENTION_HEAVY at TP 1, bf16."""
    return tokens * 2 * 8 * 8 * 2


def test_context_parallel_ring_per_backend_at_cp4():
    """At CP 4 on 4096 tokens (1024 per rank) TE's p2p ring holds two chunks of K/V (2 x 1024 tokens) and the torch
    SDPA backend the whole sequence's (4096): the plan that sizes `tools/niah.py --cp` must not swap them (at CP 2
    both are the whole length, which the existing test uses)."""
    tokens = 1024
    assert layer_working_set_bytes(ATTENTION_HEAVY, 4096, 1, 4, kernels="te") == _attention_phase(tokens) + _kv(2048)
    assert layer_working_set_bytes(ATTENTION_HEAVY, 4096, 1, 4, kernels="local") == \
        _attention_phase(tokens) + _kv(4096)


def test_no_ring_without_context_parallelism():
    """CP 1 gathers nothing: the working set is the attention phase alone, with either backend."""
    for kernels in ("te", "local"):
        assert layer_working_set_bytes(ATTENTION_HEAVY, 1024, 1, 1, kernels=kernels) == _attention_phase(1024)


@pytest.mark.parametrize("layout", [{"tensor": 0}, {"pipeline": 0}, {"context": 0}, {"context": -8}])
def test_a_zero_or_negative_layout_is_one_error_line(layout):
    """`--cp 0` and the like: a RecipeError naming the layout, not a ZeroDivisionError traceback (0) nor a plan of
    negative sizes (a negative CP divides the GPUs in Python's modulo)."""
    with pytest.raises(RecipeError, match=r"TP \S+ x PP \S+ x CP \S+ must divide the 8 GPUs"):
        eval_plan(ATTENTION_HEAVY, GPUS["h100-80gb"], 1024, gpus=8, **layout)


def test_a_replica_index_is_below_the_replica_count():
    """`first` must be below `step` (replica r of step replicas): first == step would silently count the wrong
    prompts (those of the next round), so it is refused like any other replica outside the range."""
    with pytest.raises(ValueError, match="0 <= first < step"):
        niah_pass_flops(ATTENTION_HEAVY, 1024, 4, first=2, step=2)
    assert niah_pass_flops(ATTENTION_HEAVY, 1024, 4, first=1, step=2) > 0


def test_a_plan_that_fills_the_gpu_exactly_fits():
    """`fits` is inclusive: peak bytes equal to the GPU's capacity fit (the plan's 8 GB overhead is the headroom)."""
    gpu = GPU("test-1gb", 1.0, 1.0, 1.0, 1.0, "by hand", hbm_bw=1.0)
    memory = EvalMemory(weights=0.25 * GB, kv_cache=0.25 * GB, activations=0.25 * GB, rope=0.125 * GB,
                        overhead=0.125 * GB)
    plan = EvalPlan(gpu, 1, 1024, 1, 1, 1, 1, memory, 1.0, 1.0, 1.0)
    assert plan.memory.total == GB and plan.fits
    assert not dataclasses_replace_memory(plan, overhead=0.125 * GB + 1).fits


def dataclasses_replace_memory(plan: EvalPlan, **changes: float) -> EvalPlan:
    """`plan` with some of its memory figures changed."""
    import dataclasses

    return dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, **changes))


def test_smallest_context_is_a_power_of_two():
    """Llama 3.1 8B at 2M tokens on 24 GPUs at TP 8: CP 1 does not fit and CP 2 does not divide the GPUs; CP 3 would
    fit, but the engine's context parallelism (and the advice `tools/niah.py --cp`) is a power of two: no CP here."""
    from megatron_ext.cost_model import shape_from_hf_config
    from megatron_ext.eval_plan import min_eval_context
    from megatron_ext.presets import LLAMA31_8B

    llama8b, h100 = shape_from_hf_config(LLAMA31_8B), GPUS["h100-80gb"]
    assert eval_plan(llama8b, h100, 1 << 21, gpus=24, tensor=8, context=3).fits  # what a non-power of two finds
    assert min_eval_context(llama8b, h100, 1 << 21, gpus=24, tensor=8) is None
    assert min_eval_context(llama8b, h100, 1 << 21, gpus=32, tensor=8) == 2


def test_decode_bandwidth_and_vocab_rows_are_used():
    """`hbm_bandwidth` bounds the decode step (half the bandwidth: twice the time) and `vocab_rows` (the padded
    vocabulary, plan_cli) sizes the weights: 2 vocabulary matrices (untied, PP 1) of rows x hidden / TP, bf16."""
    h100 = GPUS["h100-80gb"]
    base = eval_plan(ATTENTION_HEAVY, h100, 1024, gpus=1)
    slow = eval_plan(ATTENTION_HEAVY, h100, 1024, gpus=1, hbm_bandwidth=h100.hbm_bw / 2)
    assert slow.decode_step_s == pytest.approx(2 * base.decode_step_s, rel=1e-12)
    padded = eval_plan(ATTENTION_HEAVY, h100, 1024, gpus=1, vocab_rows=640)
    assert padded.memory.weights - base.memory.weights == pytest.approx(2 * (640 - 512) * 64 * 2, rel=1e-12)


def test_report_counts_decode_steps_in_the_niah_column():
    """`tools/plan.py --eval --new-tokens N`: the "as NIAH h" column includes the N decode steps of every prompt, as
    the full-prefill column does (before the change a mutant dropped them there: hours too low)."""
    from megatron_ext.cost_model import shape_from_hf_config
    from megatron_ext.eval_plan import eval_report
    from megatron_ext.presets import LLAMA31_8B

    llama8b = shape_from_hf_config(LLAMA31_8B)
    plan = eval_plan(llama8b, GPUS["h100-80gb"], 1 << 20, gpus=8, tensor=8)
    row = eval_report([plan], 11, 200_000, 0.35, llama8b).splitlines()[2]
    with_decode, without = plan.niah_hours(llama8b, 11, 200_000), plan.niah_hours(llama8b, 11)
    assert f"{with_decode:.2f}" != f"{without:.2f}"
    assert row.split()[-1] == f"{with_decode:.2f}"
    assert row.split()[-2] == f"{plan.grid_hours(11, 200_000):.2f}"
