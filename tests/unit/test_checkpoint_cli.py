"""tools/checkpoint.py info: a real checkpoint described, its completeness, and what a run of a recipe would do
with it (the trainer's own decision, megatron_ext.resume.plan_resume)."""

import pytest

from megatron_ext.checkpoint import save_checkpoint
from megatron_ext.checkpoint_cli import main
from megatron_ext.hf_config import hf_config_from_recipe
from megatron_ext.recipe import load_recipe
from tests.conftest import ROOT
from tests.unit.test_checkpoint import setup, step

RECIPE = str(ROOT / "recipes/tiny/cpt.yaml")
RUN = ["parallel.context=1", "train.seq_length=256", "train.global_batch_size=4", "train.steps=10"]


@pytest.fixture
def ckpt(tmp_path, cpu_parallel_state):
    """Step 2 of a run of the tiny CPT recipe: model, distributed optimizer, scheduler, 8 samples read."""
    model, ddp, opt, sched = setup(0, True)
    step(ddp, opt, sched, 0)  # Adam state exists after a step
    recipe = load_recipe(RECIPE, RUN)
    save_checkpoint(tmp_path / "run", 2, [model], optimizer=opt, scheduler=sched,  # the tiny model, the recipe's RoPE
                    metadata={"hf_config": hf_config_from_recipe(recipe), "recipe": recipe.to_dict(),
                              "consumed_samples": 8, "tokens": 2048})
    return tmp_path / "run"


def _info(capsys, *args):
    code = main(["info", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_describes_a_checkpoint(ckpt, capsys):
    code, out, _ = _info(capsys, ckpt)
    assert code == 0
    assert f"checkpoint {ckpt}: iterations [2], latest 2" in out and "iter_0000002: complete" in out
    assert "; their sizes checked, not their contents: --verify reads them)" in out  # damage of the right size passes
    assert ("layout TP 1 x PP 1 x CP 1 x DP 1, distributed optimizer True (one gradient bucket), optimizer state "
            "True") in out
    assert "position: step 2, 8 samples, 2,048 tokens" in out and "model: 2 layers, hidden 64" in out
    assert "rope yarn factor 8.0\n" in out  # the default angle precision is not named
    assert "unfinished" not in out
    (ckpt / ".iter_0000004.partial").mkdir()  # a save being written in the background, or a killed one
    code, out, _ = _info(capsys, ckpt)
    assert code == 0 and "iterations [2], latest 2\nunfinished saves [4]: being written" in out


@pytest.mark.parametrize("overrides, world, expect", [
    ([], 1, "resumes at step 2 -> 10: model, optimizer and scheduler; reads on from sample 8"),
    (["parallel.context=2"], 2, "model, optimizer and scheduler"),  # CP changes: the DP x CP slices reshard
    (["parallel.tensor=2"], 2, "the weights, with a fresh optimizer state (the distributed optimizer's state is "
                               "cut along TP x PP buckets and cannot follow parallel.tensor 1 -> 2"),
    (["train.steps=2"], 1, "nothing to train: the checkpoint is at step 2, train.steps = 2"),
    (["train.steps=20"], 1, "resumes at step 2 -> 20"),  # constant rate: nothing to warn about
    (["model.num_hidden_layers=4"], 1, "would stop: the recipe's model differs from the checkpoint's "
                                       "(num_hidden_layers: 2 -> 4)"),
    (["train.seed=7"], 1, "warning: train.seed: 1234 -> 7 (another sample order)"),
    (["rope.factor=16"], 1, "warning: RoPE rope_scaling: {"),
    (["rope.rope_theta=500000"], 1, "warning: RoPE rope_theta: 10000.0 -> 500000.0 (positions the weights were "
                                    "not trained with)"),
    (["rope.beta_fast=32"], 1, "'beta_fast': 4.0, "),
    (["rope.angle_precision=float32"], 1, "warning: RoPE rope_angle_precision: float64 -> float32"),
    (["train.precision=bf16"], 1, "the weights, with a fresh optimizer state (train.precision was fp32, now bf16)"),
    # the decay runs over train.steps: raising it to go on moves the whole curve
    (["train.lr_schedule=cosine", "train.steps=20"], 1, "warning: train.steps 10 -> 20 with the cosine learning-rate "
     "schedule, which decays over train.steps: from step 2 on the rate follows the new curve"),
    (["train.overlap_grad_reduce=true", "train.ddp_bucket_size=20000"], 1, "the weights, with a fresh optimizer "
     "state (the distributed optimizer's state is cut along its gradient buckets: one bucket when saved, buckets "
     "of 20,000 parameters now"),
])
def test_says_what_a_run_would_do(ckpt, capsys, overrides, world, expect):
    sets = [a for o in RUN + overrides for a in ("--set", o)]
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, *sets, "--world-size", world)
    assert code == 0, err
    assert expect in out, out
    assert ("warning: RoPE" in out) == any(o.startswith("rope.") for o in overrides), out
    assert ("learning-rate schedule" in out) == ("train.lr_schedule=cosine" in overrides), out


def test_fully_reshardable_checkpoint(tmp_path, cpu_parallel_state, capsys):
    """Saved with checkpoint.optimizer_sharding=fully_reshardable: named in the layout line, and a run at another
    TP or with other gradient buckets would resume the optimizer state too."""
    model, ddp, opt, sched = setup(0, True)
    step(ddp, opt, sched, 0)
    recipe = load_recipe(RECIPE, RUN + ["checkpoint.optimizer_sharding=fully_reshardable"])
    save_checkpoint(tmp_path / "run", 2, [model], optimizer=opt, scheduler=sched, optimizer_sharding="fully_reshardable",
                    metadata={"hf_config": hf_config_from_recipe(recipe), "recipe": recipe.to_dict(),
                              "consumed_samples": 8, "tokens": 2048})
    code, out, _ = _info(capsys, tmp_path / "run")
    assert code == 0 and "distributed optimizer True (saved fully_reshardable), optimizer state True" in out
    for overrides, world in [(["parallel.tensor=2"], 2), (["train.overlap_grad_reduce=true",
                                                            "train.ddp_bucket_size=20000"], 1)]:
        sets = [a for o in RUN + overrides for a in ("--set", o)]
        code, out, err = _info(capsys, tmp_path / "run", "--recipe", RECIPE, *sets, "--world-size", world)
        assert code == 0 and "model, optimizer and scheduler" in out and "fresh" not in out, out + err


@pytest.mark.parametrize("edit, out, message", [
    (lambda m: m["parallel"].update(tensor=2, pipeline=2), "new",
     "was saved at TP 2 x PP 2: reshard it on a multiple of TP x PP = 4 processes (got 1), e.g. `torchrun "
     "--nproc_per_node=4 tools/checkpoint.py reshard"),
    (lambda m: m.update(optimizer_sharding="fully_reshardable"), "new", "already saved fully_reshardable"),
    (lambda m: m["recipe"]["train"].update(distributed_optimizer=False), "new",
     "train.distributed_optimizer was false: the plain optimizer's state already loads at any layout"),
    (lambda m: m.pop("recipe"), "new", "records no training recipe and layout"),
    (lambda m: m.update(has_optimizer=False), "new", "holds no optimizer state"),
    (lambda m: None, "run/any", "is, or lies inside, the checkpoint folder"),
    (lambda m: None, "full", "exists and is not empty"),
    (lambda m: None, "full/x", "full/x is a file, not a folder: give a new folder path"),  # was a traceback
    (lambda m: None, "full/x/sub", "full/x, which is a file, not a folder"),
    (lambda m: None, "killed", "holds only the unfinished save of an interrupted run (.iter_0000002.partial): remove"),
])
def test_reshard_refuses(ckpt, capsys, tmp_path, edit, out, message):
    """What stops `tools/checkpoint.py reshard` is one line naming it, before any process group or model."""
    import json

    meta_file = ckpt / "iter_0000002/megatron_ext.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "full").mkdir()
    (tmp_path / "full/x").write_text("")
    (tmp_path / "killed/.iter_0000002.partial").mkdir(parents=True)
    code = main(["reshard", str(ckpt), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "new").exists()


def test_incomplete_and_missing(ckpt, capsys, tmp_path):
    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    shard.write_bytes(b"x")
    code, out, err = _info(capsys, ckpt)
    assert code == 1 and f"iter_0000002: INCOMPLETE: {shard.name} has 1 bytes" in out
    assert err == f"error: {ckpt}: iteration 2 is incomplete (above); no run can load it\n"
    code, _, err = _info(capsys, tmp_path / "nope")
    assert code == 1 and err.startswith("error: checkpoint directory") and "does not exist" in err
    code, _, err = _info(capsys, ckpt, "--iteration", 5)
    assert code == 1 and "has no iteration 5" in err and "available: [2]" in err
    with pytest.raises(SystemExit):
        main(["info", str(ckpt), "--iteration", "-1"])
    assert "argument --iteration: -1: an iteration is a step number >= 0" in capsys.readouterr().err


def test_folder_above_or_without_the_latest_pointer(ckpt, capsys, tmp_path):
    """The folder above a run's checkpoint.dir, or a copy that lost its latest pointer: the line says what to pass
    (it said 'pass the directory that holds iter_* folders', which for the copy is what was passed). Control: without
    the hints, neither the checkpoint below nor the iteration folder is named."""
    code, _, err = _info(capsys, tmp_path)
    assert code == 1 and err == (f"error: {tmp_path} has no latest_checkpointed_iteration.txt: it is not a Megatron "
                                 f"checkpoint root (found iterations: none); {ckpt} is a checkpoint: pass it\n")
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    code, _, err = _info(capsys, ckpt)
    assert code == 1 and err.endswith(f"(found iterations: [2]); pass {ckpt}/iter_0000002, or --iteration 2\n"), err
    code, out, err = _info(capsys, ckpt / "iter_0000002")
    assert code == 0 and "iter_0000002: complete" in out, err


def test_prelaunch_check_reports_the_resume(ckpt, capsys, token_data):
    """`python -m megatron_ext.launch --check` (what slurm/*.sh run before srun) says what the job will do with
    the checkpoint in its checkpoint.dir, and stops a job the trainer would stop anyway, before any worker."""
    from megatron_ext.launch import main as launch

    args = ["--check", "--recipe", RECIPE, "--world-size", "2", *RUN, f"data.prefix={token_data}",
            f"checkpoint.dir={ckpt}"]
    assert launch(args) == 0
    out = capsys.readouterr().out
    assert "ok: cpt: cpt TP1 PP1 CP1 DP2" in out
    assert "checkpoint: resumes at step 2 -> 10: model, optimizer and scheduler; reads on from sample 8" in out
    assert launch([*args, "model.num_hidden_layers=4"]) == 1
    assert "holds another model (num_hidden_layers: 2 -> 4)" in capsys.readouterr().err
    # output weights tied or not, another vocabulary: the load failed on an optimizer buffer's shape, or blamed the
    # vocabulary padding, or (untied into tied) dropped the trained output layer without a word
    for change, said in (("model.tie_word_embeddings=true", "tie_word_embeddings: False -> True"),
                         ("model.vocab_size=1024", "vocab_size: 512 -> 1024")):
        assert launch([*args, change]) == 1
        assert f"holds another model ({said})" in capsys.readouterr().err
        fresh = [a for a in args if not a.startswith("checkpoint.dir=")]
        assert launch([*fresh, f"checkpoint.dir={ckpt.parent / 'next'}", f"checkpoint.init_from={ckpt}", change]) == 1
        assert f"checkpoint.init_from = '{ckpt}' holds another model ({said})" in capsys.readouterr().err
    sorted((ckpt / "iter_0000002").glob("*.distcp"))[0].write_bytes(b"x")
    assert launch(args) == 1
    assert "incomplete checkpoint" in capsys.readouterr().err


def test_checkpoint_of_another_stage(ckpt, capsys, sft_data):
    """An SFT recipe whose checkpoint.dir holds the CPT run: launch --check refuses it and info says the trainer
    would stop, in the trainer's words (they said 'nothing to train' or 'resumes', exit 0). A checkpoint that
    recorded no stage (older ones) is resumed as before. Control: without the refusal, exit 0 and no 'would stop'."""
    import json

    from megatron_ext.launch import main as launch

    sft = str(ROOT / "recipes/tiny/sft.yaml")
    said = (f"checkpoint.dir = '{ckpt}' holds a cpt run (recipe 'cpt', step 2); this recipe is stage sft: give a new "
            f"checkpoint.dir (checkpoint.init_from={ckpt} loads its weights)")
    for steps in (2, 10):  # finished at the SFT's train.steps, and not
        run = [f"data.prefix={sft_data}", f"checkpoint.dir={ckpt}", f"checkpoint.init_from={ckpt}", f"train.steps={steps}"]
        assert launch(["--check", "--recipe", sft, "--world-size", "1", *run]) == 1
        assert capsys.readouterr().err == f"error: {said}\n"
        code, out, err = _info(capsys, ckpt, "--recipe", sft, *(a for o in run for a in ("--set", o)), "--world-size", 1)
        assert code == 0 and out.endswith(f"on 1 processes:\n  would stop: {said}\n"), out + err
    meta_file = ckpt / "iter_0000002/megatron_ext.json"
    meta = json.loads(meta_file.read_text())
    del meta["recipe"]["train"]["stage"]
    meta_file.write_text(json.dumps(meta))
    assert launch(["--check", "--recipe", sft, "--world-size", "1", *run]) == 0, capsys.readouterr().err
    assert "checkpoint: resumes at step 2 -> 10" in capsys.readouterr().out


def test_says_when_the_data_was_prepared_again(ckpt, capsys, tmp_path, toy_tokenizer):
    """A checkpoint that recorded its data's contents (the trainer does): other documents under the same
    data.prefix are named in the verdict like any other data change."""
    import json

    from megatron_ext.resume import data_identities
    from tests.unit.test_training_data import _prepare

    prefix = str(tmp_path / "cpt")
    _prepare(prefix, toy_tokenizer, 20)
    sets = [a for o in [*RUN, f"data.prefix={prefix}"] for a in ("--set", o)]
    meta_file = ckpt / "iter_0000002/megatron_ext.json"
    recipe = load_recipe(RECIPE, [*RUN, f"data.prefix={prefix}"])
    meta = {**json.loads(meta_file.read_text()), "recipe": recipe.to_dict(), "data_identity": data_identities(recipe)}
    meta_file.write_text(json.dumps(meta))
    assert "warning" not in _info(capsys, ckpt, "--recipe", RECIPE, *sets)[1]
    _prepare(prefix, toy_tokenizer, 30)
    code, out, err = _info(capsys, ckpt, "--recipe", RECIPE, *sets)
    assert code == 0, err
    assert f"warning: data.prefix {prefix}: contents changed (20 documents, " in out, out
    assert "-> 30 documents, " in out and "prepared again? restore the checkpoint's data" in out, out


def test_index_read_without_torch_equals_torchs(ckpt):
    """`check_complete` reads the index with torch's classes as stand-ins (no torch import): every storage entry
    (key, file, offset, length) as torch's own reader gives it; a crafted index is refused alike."""
    import os
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ext.checkpoint_index import CheckpointError, check_complete, read_dcp_index

    path = ckpt / "iter_0000002"

    def entries(index):
        return sorted((k.fqn, k.index, v.relative_path, v.offset, v.length) for k, v in index.storage_data.items())

    real, stubbed = FileSystemReader(str(path)).read_metadata(), read_dcp_index(path, stubs=True)
    assert len(real.storage_data) > 10 and entries(stubbed) == entries(real)
    assert sorted(stubbed.state_dict_metadata) == sorted(real.state_dict_metadata)

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {ckpt / 'pwned'}",))

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        check_complete(path)
    assert not (ckpt / "pwned").exists()


def test_info_and_prelaunch_check_without_torch(ckpt, token_data):
    """On a login node: `tools/checkpoint.py info` and the preflight's resume report of a job that resumes
    (every requeue) read the checkpoint without importing torch (info: 8.9 s before, 0.5 s now)."""
    import subprocess
    import sys

    probe = ("import runpy, sys\n"
             "sys.argv = sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_module(sys.argv[0], run_name='__main__') if sys.argv[0].startswith('megatron_ext') \\\n"
             "        else runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print('exit:', e.code)\n"
             "print('torch:', 'torch' in sys.modules)\n")
    for argv, said in ((["tools/checkpoint.py", "info", str(ckpt)], "iter_0000002: complete"),
                       (["megatron_ext.launch", "--check", "--recipe", RECIPE, "--world-size", "2", *RUN,
                         f"data.prefix={token_data}", f"checkpoint.dir={ckpt}"], "checkpoint: resumes at step 2")):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert said in proc.stdout and proc.stdout.endswith("exit: 0\ntorch: False\n"), proc.stdout + proc.stderr


def test_reshard_builds_the_saved_architecture_when_its_hf_config_is_gone(ckpt, tmp_path):
    """A run configured with model.hf_config=FOLDER, resharded after the folder moved (another machine): the saved
    recipe holds the architecture read from it; re-reading the path stopped reshard on a field it cannot set."""
    import json

    from megatron_ext.checkpoint_reshard import reshard_plan
    from megatron_ext.recipe import RecipeError

    meta_file = ckpt / "iter_0000002/megatron_ext.json"
    meta = json.loads(meta_file.read_text())
    meta["recipe"]["model"].update(preset=None, hf_config=str(tmp_path / "moved/hf"))
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match="no config.json there"):  # the control: the saved recipe as it is
        load_recipe(raw=meta["recipe"], world_size=1)
    _, saved, overrides = reshard_plan(ckpt, tmp_path / "new", None, 1)
    recipe = load_recipe(raw=saved["recipe"], overrides=overrides, world_size=1)
    assert hf_config_from_recipe(recipe) == meta["hf_config"]


def test_reshard_of_a_damaged_shard_is_one_line(ckpt, tmp_path):
    """A shard of the right size with damaged bytes: reshard's load failed inside torch ('PytorchStreamReader failed
    reading zip archive', a traceback). Now one line naming the file (load_checkpoint, as the trainer says it).
    Control (old code): the traceback."""
    import os
    import subprocess
    import sys

    from tests.unit.test_checkpoint import zero_after

    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[-1]
    zero_after(shard)
    proc = subprocess.run([sys.executable, str(ROOT / "tools/checkpoint.py"), "reshard", str(ckpt), "--out",
                           str(tmp_path / "new")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {shard}: cannot read its tensors (corrupt shard: ") \
        and errors[0].endswith("; copy the checkpoint again or use an earlier iteration"), proc.stderr[-3000:]
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


# tools/checkpoint.py (through runpy) that stops at one point, says `held: POINT` on stderr and goes on when a line
# comes on stdin: `save` (every shard written, in the staging folder, before the metadata and the rename), `end`
# (after main returned: --out complete, the process exiting).
HELD_RESHARD = f"""
import runpy, sys

point = sys.argv.pop(1)

def hold():
    print(f"held: {{point}}", file=sys.stderr, flush=True)
    sys.stdin.readline()

if point == "save":
    from megatron_ext import checkpoint

    real = checkpoint._finish_save

    def held(*args, **kwargs):
        hold()
        return real(*args, **kwargs)

    checkpoint._finish_save = held
    runpy.run_path({str(ROOT / "tools/checkpoint.py")!r}, run_name="__main__")
else:
    try:
        runpy.run_path({str(ROOT / "tools/checkpoint.py")!r}, run_name="__main__")
    finally:
        hold()
"""


def _held_reshard(point: str, ckpt, out):
    import os
    import subprocess
    import signal
    import sys

    # SIGINT as a terminal leaves it: CI runs the tests in the background, where it is ignored, and the reshard's
    # Python would then install no Ctrl-C handler (the SIGINT tests passed by doing nothing)
    proc = subprocess.Popen([sys.executable, "-c", HELD_RESHARD, point, "reshard", str(ckpt), "--out", str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    while not seen or seen[-1] != f"held: {point}\n":
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)
    return proc


@pytest.mark.parametrize("how, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_reshard_interrupted_in_the_save_leaves_nothing(ckpt, tmp_path, how, code):
    """Ctrl-C in a reshard was a `[rank0]: KeyboardInterrupt` traceback (exit -2) at any moment, SIGTERM a silent
    -15, and one in the save left --out holding the unfinished `.iter_*.partial`. Now one line, 130 / 143, and
    neither --out nor its staging folder."""
    import signal

    proc = _held_reshard("save", ckpt, tmp_path / "new")
    assert list(tmp_path.rglob(".iter_0000002.partial"))  # the shards are written
    proc.send_signal(getattr(signal, how))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    said = "Ctrl-C" if how == "SIGINT" else "SIGTERM"
    assert err.strip().splitlines() == [f"error: interrupted ({said}); nothing written (--out {tmp_path / 'new'} "
                                        "is made only by a complete reshard)"], err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_ctrl_c_after_a_reshard_is_complete_changes_nothing(ckpt, tmp_path):
    """A Ctrl-C once --out was complete, as the process exited (torch's teardown took a second), ended it with
    status -2 and no word. Now it exits 0. (And a killed reshard's staging folder is removed by the next.)"""
    import signal

    (tmp_path / ".new.partial/.iter_0000002.partial").mkdir(parents=True)  # left by a kill -9
    proc = _held_reshard("end", ckpt, tmp_path / "new")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert out.splitlines()[-1].startswith(f"saved {tmp_path / 'new/iter_0000002'} with the optimizer state"), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "run"]
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_prelaunch_check_counts_context_parallel_out_of_dp(ckpt, capsys, token_data):
    """The resume report of `launch --check` sizes DP as world / (TP x PP x CP): 2 tasks at CP 2 are DP 1 (by hand),
    against the checkpoint's TP 1 x PP 1 x CP 1 x DP 1. Control: CP left out of the division (DP 2)."""
    from megatron_ext.launch import main as launch

    assert launch(["--check", "--recipe", RECIPE, "--world-size", "2", *RUN, "parallel.context=2",
                   f"data.prefix={token_data}", f"checkpoint.dir={ckpt}"]) == 0, capsys.readouterr().err
    layout = [line for line in capsys.readouterr().out.splitlines() if "layout" in line]
    assert layout and layout[0].endswith("TP 1 x PP 1 x CP 1 x DP 1 -> TP 1 x PP 1 x CP 2 x DP 1"), layout
