"""Trainer bad input: one clear line on stderr and exit 1, before training starts; a diverged run stops unsaved."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, _run_ranks

RECIPE = ROOT / "recipes/tiny/cpt.yaml"
WORKERS = ROOT / "tests/distributed/workers"


def train(*overrides):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), *overrides],
                          capture_output=True, text=True, env=env, timeout=300)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_data_shorter_than_one_global_batch(tmp_path, token_data):
    proc = train(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1",
                 "train.seq_length=4096", "train.global_batch_size=64", "train.steps=1")
    assert_one_line_error(proc, "data.prefix", "fewer than one global batch", "64 x 4096")


@pytest.mark.parametrize("overrides, fragments", [
    (["data.prefix=/nonexistent/cpt"], ["data.prefix = '/nonexistent/cpt'", "tools/prepare_data.py"]),
    (["checkpoint.init_from=/nonexistent/ckpt"], ["checkpoint.init_from = '/nonexistent/ckpt'", "not a folder"]),
    (["parallel.context=2"], ["tensor x pipeline x context = 1 x 1 x 2 = 2 does not divide the world size = 1"]),
    (["train.lerning_rate=1"], ["train.lerning_rate: unknown key"]),
    (["--set", "train.lerning_rate=1"], ["train.lerning_rate: unknown key"]),  # plan.py's form, also taken
    (["runtime.fp8=hybrid"], ["runtime.fp8 = 'hybrid'"]),
    (["train.eval_interval=5"], ["train.eval_interval = 5: data.split = '100,0,0' holds no documents out"]),
    # Megatron-Core's GPTDataset would loop forever on the valid split of no tokens
    (["data.split=99.9,0.1,0"], ["data.split = '99.9,0.1,0': the valid split of data prefix", "0 tokens"]),
])
def test_static_mistakes(tmp_path, token_data, overrides, fragments):
    base = [f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1"]
    proc = train(*base, *overrides)
    assert_one_line_error(proc, *fragments)


@pytest.mark.parametrize("launcher, said", [
    ({}, " (started as 1 process: use torchrun --nproc_per_node=4 or srun)"),  # python -m megatron_ext.train alone
    ({"RANK": "0", "WORLD_SIZE": "1"}, ""),  # torchrun --nproc_per_node=1: one process chosen
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, ""),  # srun -n 1
])
def test_world_size_of_a_process_started_without_a_launcher(tmp_path, token_data, launcher, said):
    """Started without torchrun or srun, the world size is 1 by default: the line names the launcher and the fewest
    processes the layout fits. Control: without the hint, the first case lacks it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **launcher)
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), f"checkpoint.dir={tmp_path}",
                           f"data.prefix={token_data}", "parallel.tensor=2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert_one_line_error(proc)
    assert proc.stderr.splitlines()[-1] == (
        "error: parallel: tensor x pipeline x context = 2 x 1 x 2 = 4 does not divide the world size = 1; change "
        f"parallel.* or the number of processes{said}"), proc.stderr[-2000:]


def test_missing_checkpoint_dir(token_data):
    proc = train(f"data.prefix={token_data}", "parallel.context=1", "checkpoint.dir=null")
    assert_one_line_error(proc, "checkpoint.dir: missing")


@pytest.mark.parametrize("optimizer", [[], ["train.clip_grad=0", "train.distributed_optimizer=false"],
                                       ["checkpoint.async_save=true"]], ids=["default", "no-clip", "async-save"])
def test_divergence_stops_without_saving(tmp_path, token_data, cpu_parallel_state, optimizer):
    """lr 1e30: step 2's gradient norm is NaN (its update makes every weight NaN). Without the check the run went
    on, saving NaN weights at steps 2 to 5 and moving the latest pointer to them (seen by hand). Without clipping
    Megatron's optimizer still reports the norm, so the check holds there too. With background saves, step 1's
    save is put in place before the report names it."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    proc = train(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1", "train.steps=5",
                 "train.seq_length=256", "train.global_batch_size=1", "train.lr=1e30", "checkpoint.interval=1",
                 *optimizer)
    assert proc.returncode == 4, proc.stderr[-2000:]  # EXIT_DIVERGED: no requeue
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for fragment in ("step 2: loss ", "grad_norm nan: training diverged; stopped without saving; the newest "
                     f"checkpoint, {tmp_path}/iter_0000001, is from before: resume from it with a lower train.lr",
                     "this step's samples (1..1 of the run)"):
        assert fragment in errors[0], errors[0]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001"]
    weights = load_plain_tensors(str(tmp_path / "iter_0000001"))
    model = {k: t for k, t in weights.items() if hasattr(t, "isfinite") and "optimizer" not in k}
    assert "embedding.word_embeddings.weight" in model and all(bool(t.isfinite().all()) for t in model.values())
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
    diverged = json.loads(metrics[1], parse_constant=pytest.fail)  # strict JSON: no bare NaN / Infinity
    assert diverged["grad_norm"] is None and diverged["non_finite"]["grad_norm"] == "nan", diverged


def test_out_of_memory_is_one_line(tmp_path, token_data):
    """A real allocation failure (the CPU allocator refuses a 4.4 TB embedding table at once): one error line with
    the layout and what to change, not every rank's traceback."""
    proc = train(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1",
                 "model.vocab_size=17179869184")
    assert_one_line_error(proc, "error: rank 0: out of memory (DefaultCPUAllocator: can't allocate memory: you tried "
                          "to allocate 4398046511104 bytes", "at TP 1 x PP 1 x CP 1 with train.recompute = none",
                          "raise parallel.context")


def test_out_of_memory_advice_names_the_planner_command():
    import torch

    from megatron_ext.recipe import load_recipe
    from megatron_ext.train_setup import out_of_memory, out_of_memory_advice

    cpt = load_recipe(ROOT / "recipes/cpt_4m.yaml", ["parallel.context=8"], world_size=128)
    advice = out_of_memory_advice(cpt, "recipes/cpt_4m.yaml", ["parallel.context=8"], 128)
    assert "`python tools/plan.py recipes/cpt_4m.yaml --gpus 128 --set parallel.context=8` shows" in advice
    assert "train.micro_batch_size = 1 x 4194304 tokens do not fit at TP 8 x PP 1 x CP 8" in advice
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "79.11 GiB of which 30.19 MiB is free. Including non-PyTorch memory, ...")
    assert out_of_memory(cuda) == ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                   "79.11 GiB of which 30.19 MiB is free")
    assert out_of_memory(RuntimeError("Expected all tensors to be on the same device")) is None


def test_host_memory_error_is_one_line(tmp_path, token_data):
    """A mistyped train.steps (2e9) passes the checks; its sample index (numpy) needs ~156 GiB: under a 6 GiB address
    space that is a MemoryError, which is no RuntimeError (was a numpy traceback)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), "parallel.context=1",
                           f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "train.steps=2000000000"],
                          capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit)
    assert_one_line_error(proc, "out of host memory", "train.steps x train.global_batch_size = 2,000,000,000 x")


def test_latest_pointer_naming_a_missing_iteration(tmp_path, token_data):
    """The pointer names iteration 9, which is gone: the error says so and what there is, as convert and
    checkpoint info do (it said iter_0000009 'was not written by megatron_ext.checkpoint')."""
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    proc = train(f"checkpoint.dir={tmp_path}", f"data.prefix={token_data}", "parallel.context=1", "train.steps=12")
    assert_one_line_error(proc, f"{tmp_path} has no iteration 9 (iter_0000009); available: [4]")


@pytest.mark.parametrize("background", [False, True], ids=["in-place", "background"])
def test_a_save_without_room_is_one_line(tmp_path, token_data, background):
    """A checkpoint save that runs out of room: here a file-size limit (EFBIG, no root needed), which fails the
    shard writes as a full disk (ENOSPC) or a quota (EDQUOT) does. Every rank raised torch's CheckpointException,
    whose zip writer hides the errno ('unexpected pos 704 vs 598'): 139 lines, both ranks' tracebacks. Now one
    line, said by rank 0 for both, judged by a test write where the shards went; nothing published, the unfinished
    save removed, exit 1 (a requeue would fail alike). Control (old code): exit 1, 2 tracebacks, no 'error:' line."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-u", str(WORKERS / "file_size_limit.py"), "200000", "megatron_ext.train", "--recipe",
           str(RECIPE), f"checkpoint.dir={run}", f"data.prefix={token_data}", "train.steps=2",
           f"checkpoint.async_save={str(background).lower()}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    codes, _, stderr = _run_ranks(cmd, 2, env, timeout=300)
    assert 1 in codes and 0 not in codes and "Traceback" not in stderr, (codes, stderr[-4000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(re.escape(
        f"error: checkpoint.dir {run}: file too large (the file system's or the process's file-size limit, ulimit -f) "
        "while saving iteration 2 (the save needs at least 1.6 MB; judged by a 1.0 MB test write there: torch's shard "
        "writer said only 'unexpected pos ") + r"\d+ vs \d+" + re.escape(
        "'); nothing was published (there is no earlier checkpoint there); lift the file-size limit (ulimit -f) or use "
        "a file system that takes larger files"), errors[0]), stderr[-4000:]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_damaged_shard_is_named_by_each_rank(tmp_path, token_data):
    """checkpoint.init_from a checkpoint whose shards have the right size but damaged bytes (a bad copy): both ranks
    printed torch's CheckpointException (7 tracebacks). Now each rank that stops says which file it could not read,
    through the trainer's one-line path; a rank's own finding, so each says it (not marked alike). Control (old
    code): tracebacks, no error line."""
    from tests.unit.test_checkpoint import zero_after

    src = tmp_path / "src"
    first = train(f"checkpoint.dir={src}", f"data.prefix={token_data}", "parallel.context=1", "train.steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    shards = sorted(src.glob("iter_*/*.distcp"))
    for shard in shards:
        zero_after(shard)
    cmd = [sys.executable, "-u", "-m", "megatron_ext.train", "--recipe", str(RECIPE),
           f"checkpoint.dir={tmp_path / 'run'}", f"data.prefix={token_data}", f"checkpoint.init_from={src}",
           "train.steps=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    codes, _, stderr = _run_ranks(cmd, 2, env, timeout=300)
    assert 1 in codes and 0 not in codes and "Traceback" not in stderr, (codes, stderr[-4000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    said = re.compile(r"error: rank [01]: (\S+): cannot read its tensors \(corrupt shard: .*File is not a zip file\); "
                      r"copy the checkpoint again or use an earlier iteration")
    assert errors and all((m := said.fullmatch(e)) and Path(m[1]) in shards for e in errors), stderr[-4000:]


def _train_under_file_size_limit(limit: int, *overrides: str) -> tuple[list[int], str, str]:
    """The trainer on 2 ranks whose writes past `limit` bytes fail with EFBIG, as on a full disk (ENOSPC) or a quota
    (EDQUOT): (exit codes, stdout, stderr). stdout and stderr are files too, so the limit is above what they take."""
    cmd = [sys.executable, "-u", str(WORKERS / "file_size_limit.py"), str(limit), "megatron_ext.train", "--recipe",
           str(RECIPE), *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return _run_ranks(cmd, 2, env, timeout=300)


def test_a_metrics_line_without_room_is_one_line(tmp_path, token_data):
    """Rank 0's append to metrics.jsonl finds no room at step 12 (a file-size limit of 4000 bytes; a full disk or a
    quota alike): rank 0 printed the OSError's traceback (21 lines), rank 1 waited for it in the next collective
    (gloo: a 116-line 'Connection closed by peer' traceback; NCCL: until the timeout), the log ended in a cut line.
    Now one line, said by rank 0 for both, exit 1 on both; metrics.jsonl ends in a whole line. Control (old code):
    tracebacks, no 'error:' line."""
    run = tmp_path / "run"
    codes, _, stderr = _train_under_file_size_limit(4000, f"checkpoint.dir={run}", f"data.prefix={token_data}",
                                                    f"data.cache_dir={tmp_path / 'cache'}", "train.steps=15",
                                                    "train.log_interval=100")
    assert codes == [1, 1] and "Traceback" not in stderr, (codes, stderr[-4000:])
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert lines and all(json.loads(line)["step"] == n for n, line in enumerate(lines, 1)), lines[-1:]
    assert stderr.splitlines() == [
        f"error: metrics log {run / 'metrics.jsonl'}: file too large (the file system's or the process's file-size "
        f"limit, ulimit -f); training stopped after step {len(lines) + 1}, whose line is not there; there is no "
        "checkpoint yet; lift the file-size limit (ulimit -f) or use a file system that takes larger files"], stderr


def test_an_index_cache_without_room_is_one_line(tmp_path, token_data):
    """Rank 0 writes GPTDataset's index caches (Megatron-Core, straight to their final names): the document index of
    200 steps (4.4 kB) passes a file-size limit of 4000 bytes (a full disk or a quota alike). Rank 0 printed
    Megatron-Core's 'Failed to write dataset materials' traceback (51 lines), rank 1 a 'Connection closed by peer'
    one from the builder's barrier (NCCL: it waits until the timeout), and the cut .npy stayed at its final name.
    Now one line, said by rank 0 for both, exit 1 on both; nothing left in the cache folder (the description written
    before it was staged and removed). Control (stock Megatron-Core): tracebacks, no 'error:' line, a 4000-byte
    document_index.npy."""
    cache = tmp_path / "cache"
    codes, _, stderr = _train_under_file_size_limit(4000, f"checkpoint.dir={tmp_path / 'run'}",
                                                    f"data.prefix={token_data}", f"data.cache_dir={cache}",
                                                    "train.steps=200")
    assert codes == [1, 1] and "Traceback" not in stderr, (codes, stderr[-4000:])
    assert re.fullmatch(re.escape(f"error: data cache folder {cache}: file too large (the file system's or the "
                                  "process's file-size limit, ulimit -f); writing the index cache ") +
                        r"[0-9a-f]{32}-GPTDataset-train-document_index\.npy" + re.escape(
                            " failed and left nothing there; the datasets were not built; lift the file-size limit "
                            "(ulimit -f) or use a file system that takes larger files"), stderr.strip()), stderr
    assert sorted(p.name for p in cache.iterdir()) == []  # no cut .npy, no staging folder
