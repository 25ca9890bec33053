"""A pickle planted in the shared index-cache folder (Megatron-Core numpy.load()s its caches with allow_pickle=True)
is refused on every rank with rank 0's one DataError, before any rank reads it; rank 0 alone reads the files. The
trainer says it in one line and exits 1."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

WORKER = ROOT / "tests/distributed/workers/data_cache_files.py"


class _Touch:
    """Unpickling it creates `marker` (a harmless stand-in for a planted pickle's code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_planted_pickle_is_refused_on_every_rank(tmp_path, torchrun, token_data):
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    torchrun(WORKER, 2, "--prefix", token_data, "--cache", str(cache), "--marker", str(marker),
             "--out", str(tmp_path / "res"))
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    ran = sorted(p.name for p in tmp_path.glob("marker*"))
    assert not ran, f"the planted pickle ran on {ran}; errors {r0['error']}, {r1['error']}"
    assert r0["samples"] == r1["samples"]
    (planted,) = cache.glob("*-GPTDataset-train-shuffle_index.npy")
    assert r0["error"] == r1["error"] and r0["error"][0] == "DataError", (r0["error"], r1["error"])
    assert f"data cache file {planted}: is not a .npy array" in r0["error"][1] and "delete it" in r0["error"][1]
    assert (r0["vetted"], r1["vetted"]) == (2, 0)  # two builds each; rank 1 opened no cache file


def test_trainer_says_it_in_one_line(tmp_path, token_data):
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    cache.mkdir()
    planted = cache / "0123456789abcdef0123456789abcdef-GPTDataset-train-shuffle_index.npy"
    planted.write_bytes(pickle.dumps(_Touch(marker)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.train", "--recipe", str(ROOT / "recipes/tiny/cpt.yaml"),
                           f"checkpoint.dir={tmp_path / 'run'}", f"data.prefix={token_data}", f"data.cache_dir={cache}",
                           "parallel.context=1", "train.steps=1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"data cache file {planted}: is not a .npy array" in errors[0], proc.stderr[-3000:]
    assert not marker.exists()
