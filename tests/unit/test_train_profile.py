"""`profile.*`: the steps traced are the ones asked for, on the ranks asked for; the recipe rules."""

import gzip
import json

import pytest
import torch

from megatron_ext.recipe import ProfileConfig, RecipeError, load_recipe
from megatron_ext.train_profile import StepProfiler
from tests.conftest import ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"


def trace_events(path):
    """Names of a .pt.trace.json.gz's events."""
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def train_steps(profiler, steps, stop_after=None):
    """A toy training step (matmul, backward, SGD) for each step, inside `profiler.step`."""
    w = torch.randn(64, 64, requires_grad=True)
    for step in range(1, steps + 1):
        with profiler.step(step):
            loss = (torch.randn(32, 64) @ w).square().mean()
            loss.backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
                w.grad = None
        profiler.done(step)
        if step == stop_after:
            profiler.close()  # what train() does when a run stops early
            return


def check_trace(folder, rank, first, last, steps):
    trace = folder / f"rank{rank}.steps{first}-{last}.pt.trace.json.gz"
    names = trace_events(trace)
    assert {f"step {n}" for n in range(first, last + 1)} <= names, sorted(n for n in names if n.startswith("step"))
    assert not {f"step {n}" for n in range(1, steps + 1) if not first <= n <= last} & names
    assert "aten::mm" in names
    table = (folder / f"rank{rank}.steps{first}-{last}.txt").read_text()
    assert table.startswith(f"steps {first}..{last}, rank {rank}") and "aten::mm" in table
    assert not list(folder.glob(".partial-*"))


def test_traces_the_steps_asked_for(tmp_path):
    lines = []
    profiler = StepProfiler(ProfileConfig(steps=(2, 3), ranks=(0, 1)), 1, tmp_path, "cpu", log=lines.append)
    train_steps(profiler, 5)
    check_trace(tmp_path, 1, 2, 3, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.steps2-3.pt.trace.json.gz", "rank1.steps2-3.txt"]
    assert len(lines) == 1 and "steps 2..3 on rank 1" in lines[0]


def test_other_ranks_and_no_steps_trace_nothing(tmp_path):
    train_steps(StepProfiler(ProfileConfig(steps=(2, 3), ranks=(0,)), 1, tmp_path / "rank1", "cpu"), 4)
    train_steps(StepProfiler(ProfileConfig(), 0, tmp_path / "off", "cpu"), 4)
    assert not (tmp_path / "rank1").exists() and not (tmp_path / "off").exists()


def test_a_run_stopping_inside_the_range_writes_what_it_traced(tmp_path):
    profiler = StepProfiler(ProfileConfig(steps=(2, 5)), 0, tmp_path, "cpu", log=lambda _: None)
    train_steps(profiler, 6, stop_after=3)
    check_trace(tmp_path, 0, 2, 3, 6)
    profiler.close()  # nothing more to write
    assert len(list(tmp_path.iterdir())) == 2


def test_resumed_inside_the_range_traces_the_rest(tmp_path):
    profiler = StepProfiler(ProfileConfig(steps=(2, 4)), 0, tmp_path, "cpu", log=lambda _: None)
    w = torch.randn(8, 8)
    for step in (4, 5):  # a run resumed at step 3
        with profiler.step(step):
            w = w @ w
        profiler.done(step)
    names = trace_events(tmp_path / "rank0.steps4-4.pt.trace.json.gz")
    assert "step 4" in names and "step 5" not in names


@pytest.mark.parametrize("override, message", [
    ("profile.steps=[3,2]", "profile.steps = [3, 2]: expected [first, last] with 1 <= first <= last <= train.steps"),
    ("profile.steps=[5,12]", "<= train.steps = 10"),
    ("profile.steps=[3]", "profile.steps = [3]: expected [first, last]"),
    ("profile.steps=[0,1]", "1 <= first"),
    ("profile.tool=nsys", "profile.tool = 'nsys': Nsight Systems traces CUDA; use profile.tool=torch"),
    ("profile.ranks=[0,2]", "profile.ranks = [0, 2]: the run has ranks 0..1"),
    ("profile.ranks=[]", "profile.ranks = []: expected a list of global ranks"),
    ("profile.step=[1,2]", "profile.step: unknown key (did you mean 'steps'?)"),
])
def test_profile_rules(override, message):
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, ["train.steps=10", "parallel.context=1", "train.global_batch_size=2", override], world_size=2)
    assert message in str(e.value)


def test_profile_steps_load():
    recipe = load_recipe(RECIPE, ["train.steps=10", "parallel.context=1", "train.global_batch_size=2", "profile.steps=[4,5]"], world_size=2)
    assert recipe.profile.steps == (4, 5) and recipe.profile.ranks == (0,) and recipe.profile.tool == "torch"


def test_memory_records_allocations_into_a_folder_not_yet_there(tmp_path):
    """`profile.memory` reaches torch.profiler (profile_memory: '[memory]' allocation events in the trace, none
    without it), and the trace folder is created with its missing parents (`profile.dir` may name a new tree).
    Pins of the mutation audit (round 6): both were dropped without a test failing."""
    for memory in (True, False):
        folder = tmp_path / f"memory-{memory}" / "profile"
        train_steps(StepProfiler(ProfileConfig(steps=(1, 1), memory=memory), 0, folder, "cpu", log=lambda _: None), 1)
        assert ("[memory]" in trace_events(folder / "rank0.steps1-1.pt.trace.json.gz")) == memory
