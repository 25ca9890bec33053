"""Where a run starts (megatron_ext.train_start.start_point), on a real checkpoint of the tiny model in one gloo
process: the saved position, the state loaded into the model / optimizer / scheduler, the recipe's optimizer
settings over the saved ones, and the refusals, before anything is loaded."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_ext.checkpoint import CheckpointError, save_checkpoint
from megatron_ext.hf_config import hf_config_from_recipe
from megatron_ext.recipe import load_recipe
from megatron_ext.train_start import StartPoint, start_point
from tests.conftest import ROOT
from tests.unit.test_checkpoint import params, setup, step

RUN = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=4", "train.steps=10"]


def _recipe(root, *overrides, name="cpt"):
    return load_recipe(ROOT / f"recipes/tiny/{name}.yaml", [*RUN, f"checkpoint.dir={root}", *overrides])


@pytest.fixture
def saved(tmp_path, cpu_parallel_state):
    """Step 2 of a run (Adam at max_lr 1e-2, betas (0.9, 0.999), eps 1e-8): 8 samples and 2,048 tokens read, its data
    order built for 64 samples; its weights."""
    model, ddp, opt, sched = setup(0, True)
    step(ddp, opt, sched, 0)
    step(ddp, opt, sched, 1)
    root = tmp_path / "run"
    recipe = _recipe(root)
    save_checkpoint(root, 2, [model], optimizer=opt, scheduler=sched,
                    metadata={"hf_config": hf_config_from_recipe(recipe), "recipe": recipe.to_dict(),
                              "consumed_samples": 8, "tokens": 2048, "data_samples": 64,
                              "generation_config": {"eos_token_id": 7}})
    return root, params(model)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_loads_the_state_at_the_saved_position_with_the_recipes_optimizer_settings(saved):
    """The saved step, samples, tokens and data request; the saved weights and schedule position; the recipe's peak
    rate and Adam settings (not the saved param groups'); what the checkpoint knows carried into the run's metadata.
    A checkpoint.init_from is not read on a resume (a requeue of a stage whose converted model is gone)."""
    root, weights = saved
    recipe = _recipe(root, "train.lr=3e-3", "train.min_lr=1e-3", "train.adam_beta2=0.99", "train.adam_eps=1e-6",
                     "checkpoint.init_from=/nonexistent/hf")
    model, _, opt, sched = setup(1, True)
    metadata = {"hf_config": {}}
    begin = start_point(recipe, model, opt, sched, metadata, {}, 1)
    assert begin == StartPoint(step=2, consumed_samples=8, tokens=2048, data_samples=64, finished=False)
    assert _same(params(model), weights)
    assert sched.num_steps == 2
    for group in opt.param_groups:
        assert (group["max_lr"], group["min_lr"]) == (3e-3, 1e-3)
        assert group["betas"] == (0.9, 0.99) and group["eps"] == 1e-6
        assert group["lr"] == pytest.approx(3e-3)  # the end of the 2-step warm-up: the recipe's peak, not 1e-2
    assert metadata["generation_config"] == {"eos_token_id": 7}


def test_resume_in_another_layout_loads_the_weights_and_keeps_the_schedule_position(saved, capsys):
    """The optimizer state cannot follow (here: no distributed optimizer now): the weights load, the optimizer
    starts fresh, and the scheduler goes on from the saved step (its warm-up is over, not started again)."""
    root, weights = saved
    model, _, opt, sched = setup(1, False)
    begin = start_point(_recipe(root, "train.distributed_optimizer=false", "train.lr=3e-3"), model, opt, sched,
                        {"hf_config": {}}, {}, 1)
    assert (begin.step, begin.consumed_samples, begin.tokens) == (2, 8, 2048)
    assert _same(params(model), weights)
    assert sched.num_steps == 2 and all(g["lr"] == pytest.approx(3e-3) for g in opt.param_groups)
    assert "with a fresh optimizer state: train.distributed_optimizer was True, now False" in capsys.readouterr().out


def test_a_finished_run_loads_nothing(saved):
    root, weights = saved
    model, _, opt, sched = setup(1, True)
    before = params(model)
    assert start_point(_recipe(root, "train.steps=2"), model, opt, sched, {"hf_config": {}}, {}, 1) == \
        StartPoint(step=2, finished=True)
    assert _same(params(model), before) and not _same(before, weights)


def test_a_checkpoint_of_another_stage_or_model_is_refused_before_loading(saved, sft_data):
    """Another stage is refused even when the checkpoint is at the recipe's train.steps (it ended at once, exit 0);
    another model before its load fails on a shape."""
    root, _ = saved
    model, _, opt, sched = setup(1, True)
    before = params(model)
    sft = _recipe(root, f"data.prefix={sft_data}", "train.steps=2", name="sft")
    with pytest.raises(CheckpointError, match=rf"^checkpoint.dir = '{root}' holds a cpt run \(recipe 'cpt', step 2\); "
                                              "this recipe is stage sft"):
        start_point(sft, model, opt, sched, {"hf_config": {}}, {}, 1)
    with pytest.raises(CheckpointError, match=r"holds another model \(tie_word_embeddings: False -> True\)"):
        start_point(_recipe(root, "model.tie_word_embeddings=true"), model, opt, sched, {"hf_config": {}}, {}, 1)
    assert _same(params(model), before)


def test_no_checkpoint_and_no_init_from_is_a_new_run(tmp_path, cpu_parallel_state):
    model, _, opt, sched = setup(1, True)
    before = params(model)
    assert start_point(_recipe(tmp_path / "new"), model, opt, sched, {"hf_config": {}}, {}, 1) == StartPoint()
    assert _same(params(model), before)


def test_a_ctrl_c_wrapped_before_the_loop_is_the_unsaved_stop(monkeypatch, capsys):
    """A Ctrl-C before the loop that reached train.main wrapped (Python 3.11 turns one raised in a class body's
    `__set_name__`, as in a first import while the model is built, into a RuntimeError) was a traceback, exit 1. Now
    the unsaved stop's line and 130; an error wrapped the same way stays an error (the negative control). Control
    (old train.py): the RuntimeError escapes main."""
    import signal

    from megatron_ext import train
    from tests.unit.test_signals import _in_set_name

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}

    def wrapped(raise_it):
        monkeypatch.setattr(train, "_run", lambda args, stop: _in_set_name(lambda: raise_it(stop)))
        try:
            return train.main(["--recipe", str(ROOT / "recipes/tiny/cpt.yaml")])
        finally:  # StopFlag ignores the signals from its settle on: not in the test process
            for s, handler in handlers.items():
                signal.signal(s, handler)

    assert wrapped(lambda stop: stop._handle(signal.SIGINT, None)) == train.EXIT_INTERRUPTED  # its Ctrl-C handler
    assert "[train] interrupted (Ctrl-C) before the first step" in capsys.readouterr().err

    def error(stop):
        raise ValueError("an error")

    with pytest.raises(Exception) as raised:
        wrapped(error)
    assert isinstance(raised.value.__cause__ if sys.version_info < (3, 12) else raised.value, ValueError)
