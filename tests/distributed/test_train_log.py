"""What a multi-rank run prints: library warnings once (rank 0's), not once per rank; a header naming the layout and
where the outputs go; a closing line with the steps, tokens and the final checkpoint."""

import json
import os
import re
import subprocess
import sys
from collections import Counter

from megatron_ext.runtime.job_env import free_port
from tests.conftest import CUDA, ROOT

RECIPE = ROOT / "recipes/tiny/cpt.yaml"
TIME = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")  # the local time that starts each trainer line


def two_ranks(out, data, steps: int, *overrides: str, **env_extra: str) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of a tiny CPT run, started as torchrun starts them (one node), output piped."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    env.pop("PYTHONWARNINGS", None)  # this shell's: warnings shown unless the caller says otherwise
    env.update(env_extra)
    cmd = [sys.executable, "-m", "megatron_ext.train", "--recipe", str(RECIPE), f"checkpoint.dir={out}",
           f"data.prefix={data}", "parallel.context=1", "train.seq_length=512", "train.global_batch_size=2",
           f"train.steps={steps}", *overrides]
    return [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(2)]


def test_two_ranks_print_library_warnings_once(tmp_path, token_data):
    # no PYTHONWARNINGS=ignore here (the other tests set it): the warnings are what this test counts
    out = tmp_path / "run"
    procs = two_ranks(out, token_data, 2, "train.log_interval=2")
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-3000:]
    stdout = results[0][0] + results[1][0]
    stderr = results[0][1] + results[1][1]
    warnings = Counter(line for line in stderr.splitlines() if "Warning: " in line)
    if not CUDA:  # on the CPU Megatron warns that TE and Apex are missing: there is something to count
        assert any("Transformer Engine and Apex are not installed" in w for w in warnings), stderr[-3000:]
    assert all(n == 1 for n in warnings.values()), warnings.most_common(3)
    assert results[1][0] == ""  # the other rank prints nothing on stdout
    # each line of the trainer's carries the local time before its tag (train_metrics.log)
    lines = stdout.strip().splitlines()
    ours = [line for line in lines if "[train] " in line]
    assert ours and all(TIME.match(line) for line in ours), stdout
    lines = [TIME.sub("", line, count=1) for line in lines]
    header = [line for line in lines if line.startswith("[train] cpt: ")]
    assert len(header) == 1 and "DP2 (2 ranks)" in header[0] and "(2,048 tokens)" in header[0]
    assert f"metrics.jsonl in {out}" in header[0]
    done = lines[-1]
    assert done.startswith("[train] done: steps 1..2 in ") and " 2,048 tokens " in done, stdout
    assert done.endswith(f"checkpoint {out}/iter_0000002, metrics {out / 'metrics.jsonl'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["consumed_samples"] for r in records] == [2, 4]
    assert records[0]["time"] <= records[1]["time"]
    # log_interval 2: one line, for step 2, whose loss is the token mean of steps 1 and 2 (not step 2's: control)
    steps = [line for line in lines if line.startswith("[train] step ")]
    assert len(steps) == 1 and steps[0].startswith("[train] step 2/2 loss "), stdout
    mean = sum(r["loss"] * r["loss_tokens"] for r in records) / sum(r["loss_tokens"] for r in records)
    assert f"loss {mean:.4f} " in steps[0] and f"loss {records[1]['loss']:.4f} " not in steps[0], (steps, records)


def test_a_signal_to_one_rank_stops_both_for_requeue(tmp_path, token_data):
    """SIGUSR1 to one rank of two (a `kill` aimed at one process; a signal reaching ranks at different steps): the
    ranks agree at the step's end, both save and exit 3. Rank 0, which got no signal itself, reports it as heard
    from another rank (its stop.signal is None: naming it crashed that rank after the save, no requeue)."""
    import signal
    import time

    from megatron_ext.train import EXIT_REQUEUE

    out = tmp_path / "run"
    procs = two_ranks(out, token_data, 1000, PYTHONWARNINGS="ignore")
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the run did not get going"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGUSR1)
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_REQUEUE, EXIT_REQUEUE], results[0][1][-3000:] + results[1][1][-3000:]
    assert "received a stop signal on another rank; checkpoint saved" in results[0][0], results[0][0][-2000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)


def test_a_setup_mistake_rank_zero_found_for_all_is_said_once(tmp_path, token_data):
    """Rank 0 checks the data caches and plans a resume for every rank (`rank_zero_outcome`): a refusal there is the
    same on every rank, and rank 0 alone says it (before, every rank printed the line: 512 copies in a 512-GPU log).
    Control: with each rank printing its own, both cases show two lines."""
    def errors(procs) -> list[str]:
        results = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [1, 1], results[0][1][-3000:]
        assert all("Traceback" not in err for _, err in results), results[0][1][-3000:] + results[1][1][-3000:]
        return [[line for line in err.splitlines() if line.startswith("error: ")] for _, err in results]

    cache = tmp_path / "cache"
    cache.mkdir()
    junk = cache / "0123456789abcdef0123456789abcdef-GPTDataset-train-shuffle_index.npy"
    junk.write_bytes(b"not an array")
    said = errors(two_ranks(tmp_path / "a", token_data, 1, f"data.cache_dir={cache}", PYTHONWARNINGS="ignore"))
    assert len(said[0]) == 1 and said[1] == [] and f"data cache file {junk}: is not a .npy array" in said[0][0], said

    run = tmp_path / "b"
    procs = two_ranks(run, token_data, 1, PYTHONWARNINGS="ignore")
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-3000:]
    said = errors(two_ranks(run, token_data, 2, "model.tie_word_embeddings=true", PYTHONWARNINGS="ignore"))
    assert said == [[f"error: checkpoint.dir = '{run}' holds another model (tie_word_embeddings: False -> True): use "
                     "the checkpoint's model.* settings, or a new checkpoint.dir (with checkpoint.init_from for a new "
                     "stage)"], []], said
