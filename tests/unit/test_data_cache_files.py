"""Megatron-Core reads GPTDataset's and BlendedDataset's index caches with numpy.load(allow_pickle=True): a pickle
planted as one of them (the names are a predictable hash; the cache folder is beside the data, often shared) ran
its code in every rank. `build_cpt_datasets` refuses such a file before the builder reads anything, naming it."""

from __future__ import annotations

import pickle
import re
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


@pytest.mark.parametrize("affix", ["shuffle_index", "document_index"])
def test_a_cache_cut_short_is_built_again(tmp_path, token_data, affix):
    """A cache .npy cut short at its final name (stock Megatron-Core and this code before it staged its writes wrote in
    place: a kill or a full disk left one there) made every later start fail in numpy.load ('mmap length is greater
    than file size'): all names present count as a cache. Now it is built again and replaced."""
    cache = tmp_path / "cache"
    expected = _samples(build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0])
    (cut,) = cache.glob(f"*-GPTDataset-train-{affix}.npy")
    whole = cut.read_bytes()
    cut.write_bytes(whole[:len(whole) // 2])
    assert _samples(build_cpt_datasets(token_data, S, seed=3, cache_dir=str(cache))[0]) == expected
    assert cut.read_bytes() == whole


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
    all present Megatron-Core loads them ('mmap length is greater than file size' at every later start). Now the four
    are written in a staging folder and moved into place: a failed write leaves nothing in the cache folder (the two
    written before it are removed with the staging folder), and is one DataError naming the folder and the file, its
    errno judged by a test write where numpy hid it. Control (stock Megatron-Core): numpy's 'OSError: 3030 requested
    and 218 written' traceback (its errno lost), the sample index cut at 1000 of its 12 kB at its final name."""
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
    assert list(cache.iterdir()) == []  # neither the staging folder nor the two written before it
    # with room, the same build writes them all, whole
    build_cpt_datasets(token_data, 32, num_samples=(100, None, None), cache_dir=str(cache))
    assert sorted(p.name.split("-", 1)[1] for p in cache.iterdir()) == [
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy"]
    for npy in cache.glob("*.npy"):
        np.load(npy)


def _cache_names(folder: Path) -> list[str]:
    """The names in `folder` but a staging folder's (dot names: no cache lookup matches them)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _build_killed_while_writing(token_data: str, cache: Path) -> int:
    """A build (a subprocess) killed inside its cache writes by SIGXFSZ, the default action of a write past a
    file-size limit, as a kill -9 or a node's loss would end it (no handler runs): after the description and the
    document index were written, inside the sample index's write. Its pid."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))

    code = """
import signal, sys
from megatron_ext.data import build_cpt_datasets
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; its default ends the process at the write
build_cpt_datasets(sys.argv[1], 32, num_samples=(100, None, None), cache_dir=sys.argv[2])
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, "-c", code, token_data, str(cache)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=limited)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, err[-3000:])
    return proc.pid


def test_a_build_killed_while_writing_leaves_no_cache_name(tmp_path, token_data):
    """A build killed partway through its cache writes (`_build_killed_while_writing`): the cache folder holds no
    name of this build's caches, only the dead process's staging folder, which nothing reads; the next build writes
    the four and loads them. Control (f087277's temporary-and-rename writes): the description and the document index
    at their final names and 'sample_index.npy.tmp<pid>' beside them; stock Megatron-Core: the sample index cut at its
    final name."""
    cache = tmp_path / "cache"
    _build_killed_while_writing(token_data, cache)
    assert _cache_names(cache) == [], _cache_names(cache)
    (staging,) = cache.iterdir()  # the killed build's, with what it had written
    assert sorted(p.name.split("-", 1)[1] for p in staging.iterdir()) == [
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy", "GPTDataset-train-sample_index.npy"]
    train = build_cpt_datasets(token_data, 32, num_samples=(100, None, None), cache_dir=str(cache))[0]
    assert [n.split("-", 1)[1] for n in _cache_names(cache)] == [
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy"]
    again = build_cpt_datasets(token_data, 32, num_samples=(100, None, None), cache_dir=str(cache))[0]  # loaded
    assert len(again) == len(train) >= 100 and again[7]["tokens"].tolist() == train[7]["tokens"].tolist()


def test_a_later_build_removes_the_staging_folders_of_dead_builds(tmp_path, token_data, capsys):
    """A killed build's staging folder (hundreds of MB to GBs at scale, one more for every requeued job killed while
    it built) stayed in the cache folder for good. Now the next build removes those of its host whose process is
    gone, saying so in one line with their size, and keeps a live build's (a sleeping child's pid; several jobs may
    build in one folder at once) and this process's. Those named by another host or PID namespace (a container), whose
    process cannot be asked, and an older version's (no host) are kept until they are a week old. A build that only
    reads (a cache hit) removes them too: the live one once its process has ended. Control (no removal): the dead
    build's folder is still there."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from megatron_ext.data.index_caches import STAGING_PREFIX

    cache = tmp_path / "cache"
    pid = _build_killed_while_writing(token_data, cache)
    (dead,) = cache.iterdir()
    assert f"-{pid}-" in dead.name
    dead_bytes = sum(p.stat().st_size for p in dead.iterdir())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        live, mine = (cache / dead.name.replace(f"-{pid}-", f"-{p}-") for p in (sleeper.pid, os.getpid()))
        for folder in (live, mine):
            folder.mkdir()
            (folder / "part.npy").write_bytes(b"\0" * 300_000)
        kwargs = dict(num_samples=(100, None, None), cache_dir=str(cache))
        build_cpt_datasets(token_data, 32, **kwargs)  # a miss: this build writes the caches
        assert not dead.exists()
        assert live.is_dir() and mine.is_dir() and len(_cache_names(cache)) == 4
        said = [line for line in capsys.readouterr().out.splitlines() if "[data]" in line]
        mb = f"{dead_bytes / 1e6:.1f} MB"
        assert len(said) == 1 and f"data cache folder {cache}: removed {dead.name} ({mb})" in said[0], said

        here = f"{STAGING_PREFIX}{socket.gethostname()}-"
        namespace, rest = dead.name[len(here):].split("-", 1)  # the dead pid's, named by
        foreign = [cache / f"{STAGING_PREFIX}far-{namespace}-{rest}",  # another host
                   cache / f"{here}{int(namespace) + 1}-{rest}",  # another container on this host
                   cache / f"{STAGING_PREFIX}{rest}"]  # an older version
        old = cache / f"{STAGING_PREFIX}old-{namespace}-{rest}"
        for folder in (*foreign, old):
            folder.mkdir()
            (folder / "part.npy").write_bytes(b"\0" * 300_000)
        week_ago = time.time() - 7 * 24 * 3600 - 60
        for path in (old / "part.npy", old):
            os.utime(path, (week_ago, week_ago))
        sleeper.kill()
        sleeper.wait()
        build_cpt_datasets(token_data, 32, **kwargs)  # a hit
        assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == sorted(
            p.name for p in (mine, *foreign))
        said = [line for line in capsys.readouterr().out.splitlines() if "[data]" in line]
        assert len(said) == 1 and "(0.6 MB)" in said[0] and live.name in said[0] and old.name in said[0], said
    finally:
        sleeper.kill()
        sleeper.wait()


def test_index_caches_are_stock_megatron_cores_files(tmp_path, token_data, second_token_data):
    """The caches are written by subclasses of Megatron-Core's GPTDataset and BlendedDataset (their way to stage the
    writes): the file names (which existing caches, `check_index_caches` and the data identity rely on) and bytes
    are those stock Megatron-Core's builder writes, for a split prefix (train and valid) and a weighted blend (which
    caches only under torch.distributed: a 1-rank gloo group here, in a subprocess)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = """
import dataclasses, sys
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron_ext.data import build_cpt_datasets
prefix, second, ours, stock, store = sys.argv[1:]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
builds = [((prefix, 32), dict(num_samples=(100, 10, None), split="90,10,0")),
          (([prefix, second], 32), dict(weights=[0.7, 0.3], num_samples=(40, None, None)))]
for args, kwargs in builds:
    datasets = build_cpt_datasets(*args, seed=3, cache_dir=ours, **kwargs)
    assert type(datasets[0]).__module__ == "megatron_ext.data.index_caches", type(datasets[0])  # the subclass's
    config = dataclasses.replace(datasets[0].config, path_to_cache=stock)
    BlendedMegatronDatasetBuilder(GPTDataset, list(kwargs["num_samples"]), lambda: True, config).build()
dist.destroy_process_group()
"""
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, token_data, second_token_data, str(ours), str(stock),
                           str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in stock.iterdir())
    kinds = sorted({n.split("-", 1)[1].rsplit("-", 1)[0] for n in names})
    # split: train 4 + valid 4 files; blend: 4 for each prefix and 3 for the BlendedDataset
    assert kinds == ["BlendedDataset-train", "GPTDataset-train", "GPTDataset-valid"] and len(names) == 19, names
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        assert (ours / name).read_bytes() == (stock / name).read_bytes(), name


def test_a_blend_whose_cache_write_fails_is_one_error(tmp_path, token_data, second_token_data):
    """A blend (cached only under torch.distributed: a 1-rank gloo group, in a subprocess) under a file-size limit of
    1000 bytes: a GPTDataset's failed write leaves placeholders of its length, so Megatron-Core's builder finishes its
    BlendedDataset (weighted, and sized by the datasets' lengths) without writing, and the build is one DataError
    naming the file, the cache folder left empty; with the GPTDataset caches there, the BlendedDataset's own write
    fails alike (its description, 1.3 kB) and leaves only those. (One process: a soft limit is lifted again without
    privileges.) Control: without the placeholders the builder's asserts fail."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = """
import glob, json, os, resource, sys
import torch.distributed as dist
from megatron_ext.data import DataError, build_cpt_datasets
prefix, second, cache, store = sys.argv[1:]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
for step in ("limited", "room", "limited"):
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000 if step == "limited" else hard, hard))
    for weights in ([0.7, 0.3], None):
        try:
            build_cpt_datasets([prefix, second], 32, weights=weights, num_samples=(40, None, None), cache_dir=cache)
            print("built")
        except DataError as e:
            print(e)
    print(json.dumps(sorted(os.listdir(cache))))
    for blended in glob.glob(os.path.join(cache, "*-BlendedDataset-*")):
        os.unlink(blended)
dist.destroy_process_group()
"""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, token_data, second_token_data, str(cache),
                           str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = proc.stdout.splitlines()
    assert len(said) == 9, said
    assert all(line.startswith(f"data cache folder {cache}: file too large") and re.search(
        r"writing the index cache [0-9a-f]{32}-GPTDataset-train-sample_index\.npy failed and left nothing there",
        line) for line in said[:2]) and said[2] == "[]", said[:3]
    assert said[3:5] == ["built", "built"]
    gpt = sorted(n for n in json.loads(said[5]) if "-GPTDataset-" in n)
    assert len(gpt) == 4 * 4 and len(json.loads(said[5])) == len(gpt) + 2 * 3, said[5]
    assert all(re.search(r"writing the index cache [0-9a-f]{32}-BlendedDataset-train-description\.txt failed "
                         "and left nothing there", line) for line in said[6:8]) and json.loads(said[8]) == gpt, said[6:]
