"""Megatron-Core reads GPTDataset's and BlendedDataset's index caches with numpy.load(allow_pickle=True): a pickle
planted as one of them (the names are a predictable hash; the cache folder is beside the data, often shared) ran
its code in every rank. `build_cpt_datasets` refuses such a file before the builder reads anything, naming it."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.data import DataError, build_cpt_datasets
from tests.conftest import _cpt_data

S = 32


class _Payload:
    """Unpickling it creates `marker`: what a planted pickle could do, made visible and harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(marker)))


def _samples(ds) -> list[list[int]]:
    return [ds[i]["tokens"].tolist() for i in range(0, len(ds), 5)]


def _build_catching(*args, **kwargs) -> Exception | None:
    try:
        build_cpt_datasets(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the unfixed code fails after unpickling; the marker is the point
        return e
    return None


@pytest.mark.parametrize("affix", ["shuffle_index", "sample_index", "document_index"])
def test_pickled_index_cache_is_refused_before_it_is_read(tmp_path, token_data, affix):
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    first = build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0]
    expected = _samples(first)
    (planted,) = cache.glob(f"*-GPTDataset-train-{affix}.npy")
    _plant(planted, marker)
    error = _build_catching(token_data, S, seed=3, cache_dir=str(cache))
    assert not marker.exists(), f"the planted pickle ran (build raised {error!r})"
    assert isinstance(error, DataError), repr(error)
    message = str(error)
    assert str(planted) in message and "pickle" in message and "delete it" in message, message
    assert "\n" not in message
    planted.unlink()  # the fix the message names: the next build rebuilds the cache
    assert _samples(build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0]) == expected
    assert planted.exists()


def test_valid_caches_are_read_again(tmp_path, token_data):
    cache = tmp_path / "cache"
    first = _samples(build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0])
    files = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert len([p for p in files if p.suffix == ".npy"]) == 3
    assert _samples(build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0]) == first
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == files  # read, not rebuilt


def test_every_npy_in_the_folder_is_vetted(tmp_path, token_data):
    """Another run's caches share the folder; their names cannot be told apart from this build's before Megatron's
    builder hashes its settings, so any pickled or object .npy there is refused; an empty file or a .npy whose data
    is still being written (another run's rank 0 saving it now) is no risk and passes."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))
    header_only = cache / "0123-GPTDataset-train-sample_index.npy"
    np.save(header_only, np.zeros((1000, 2), dtype=np.int64))
    header_only.write_bytes(header_only.read_bytes()[:200])
    (cache / "4567-GPTDataset-valid-shuffle_index.npy").write_bytes(b"")
    (cache / "notes.txt").write_bytes(pickle.dumps(_Payload(marker)))  # Megatron reads no such file
    build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))
    objects = cache / "89ab-BlendedDataset-train-dataset_index.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=f"{objects}: holds Python objects"):
        build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))
    objects.unlink()
    zipped = cache / "cdef-GPTDataset-test-document_index.npy"
    with open(zipped, "wb") as f:
        np.savez(f, a=np.arange(3))
    with pytest.raises(DataError, match=f"{zipped}: is not a .npy array"):
        build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))
    assert not marker.exists()


def _blend_outside_torch_distributed(tmp: str, toy_tokenizer: str) -> None:
    """The blend case, in a process without a process group (the tests' session-wide one sends the caches to one
    folder beside the data instead)."""
    import torch

    assert not torch.distributed.is_initialized()
    tmp_path = Path(tmp)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _cpt_data(tmp_path / "a", toy_tokenizer, 20, seed=1)
    b = _cpt_data(tmp_path / "b", toy_tokenizer, 20, seed=2)
    marker = tmp_path / "marker"
    kwargs = dict(weights=[0.5, 0.5], seed=3, num_samples=(20, None, None))
    expected = _samples(build_cpt_datasets([a, b], S, **kwargs)[0])
    (planted,) = Path(b, "cache", "GPTDataset_indices").glob("*-shuffle_index.npy")
    _plant(planted, marker)
    error = _build_catching([a, b], S, **kwargs)
    assert not marker.exists(), f"the planted pickle ran (build raised {error!r})"
    assert isinstance(error, DataError) and str(planted) in str(error), repr(error)
    planted.unlink()
    assert _samples(build_cpt_datasets([a, b], S, **kwargs)[0]) == expected


def test_blend_outside_torch_distributed_vets_each_prefix_cache(tmp_path, toy_tokenizer):
    """Without torch.distributed a blend's GPTDatasets cache under PREFIX/cache/GPTDataset_indices (Megatron-Core's
    default; its BlendedDataset cache needs a process group): those folders are vetted. In a subprocess: the
    session's cpu_parallel_state group, once any earlier test made it, stays for the rest of the run."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("from tests.unit.test_data_cache_files import _blend_outside_torch_distributed as f; "
            f"f({str(tmp_path)!r}, {str(toy_tokenizer)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_pre_launch_check_names_the_file(tmp_path, token_data, monkeypatch, capsys):
    """`launch --check` (every sbatch script's preflight, on the login node) vets the cache folder too: the job stops
    before its workers queue, not after they all started. Control: the same check passes once the file is gone."""
    from megatron_ext import launch
    from tests.conftest import ROOT

    cache = tmp_path / "cache"
    cache.mkdir()
    junk = cache / "0123456789abcdef0123456789abcdef-GPTDataset-train-shuffle_index.npy"
    junk.write_bytes(b"not an array")
    args = ["--check", "--recipe", "recipes/tiny/cpt.yaml", "--world-size", "2", f"data.prefix={token_data}",
            f"data.cache_dir={cache}", f"checkpoint.dir={tmp_path / 'run'}"]
    monkeypatch.chdir(ROOT)
    assert launch.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.cache_dir: data cache file {junk}: is not a .npy array") and "delete it" in err
    assert err.count("\n") == 1, err
    junk.unlink()
    assert launch.main(args) == 0, capsys.readouterr().err


def test_an_index_cache_write_without_room_leaves_no_cut_file(tmp_path, token_data):
    """Megatron-Core numpy.save()d each index cache straight to its final name: a write that ran out of room (a
    file-size limit here, EFBIG; a full disk or a quota alike) left a cut .npy there, and once a build's names are
    all present Megatron-Core loads them ('mmap length is greater than file size' at every later start). Now each is
    written under a temporary name and renamed: a failed one leaves nothing, its temporary removed, and is one
    DataError naming the folder and the file. Control (old code): numpy's 'OSError: 3030 requested and 218 written'
    traceback (its errno lost), the sample index cut at 1000 of its 12 kB at its final name."""
    import os
    import resource
    import subprocess
    import sys

    from tests.conftest import ROOT

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    code = """
import sys
from megatron_ext.data import DataError, build_cpt_datasets
try:
    build_cpt_datasets(sys.argv[1], 32, num_samples=(100, None, None), cache_dir=sys.argv[2])
except DataError as e:
    print(e)
"""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, token_data, str(cache)], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=limited)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"data cache folder {cache}: file too large") and \
        "-GPTDataset-train-sample_index.npy failed and left nothing there" in proc.stdout, proc.stdout
    assert sorted(p.name.split("-", 1)[1] for p in cache.iterdir()) == [  # the two written before it, whole
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy"]
    for npy in cache.glob("*.npy"):
        np.load(npy)
    # with room, the same build writes them all, whole
    build_cpt_datasets(token_data, 32, num_samples=(100, None, None), cache_dir=str(cache))
    assert sorted(p.name.split("-", 1)[1] for p in cache.iterdir()) == [
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy"]
    for npy in cache.glob("*.npy"):
        np.load(npy)
