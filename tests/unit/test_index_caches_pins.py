"""Pins for megatron_ext/data/index_caches.py that test_data_cache_files left open (mutation audit round 6), on
`remove_dead_staging` called directly on hand-made staging folders (no dataset build: milliseconds). Oracle: its
docstring, a folder of another host is removed only when neither it nor a file in it was touched for a week."""

from __future__ import annotations

import os
import time

from megatron_ext.data.index_caches import STAGING_PREFIX, STALE_AFTER_S, remove_dead_staging


def test_another_hosts_staging_folder_is_kept_while_a_file_in_it_is_written(tmp_path):
    """A build on another host (its pid cannot be asked) whose staging folder was made over a week ago but whose
    file was written just now is live (a long build; one suspended by preemption and resumed): kept. Its twin with
    everything a week old is removed."""
    week_ago = time.time() - STALE_AFTER_S - 60
    live, stale = (tmp_path / f"{STAGING_PREFIX}far-host-4026531836-{pid}-0123abcd" for pid in (11, 12))
    for folder in (live, stale):
        folder.mkdir()
        (folder / "part.npy").write_bytes(b"\0" * 1000)
    os.utime(stale / "part.npy", (week_ago, week_ago))
    for folder in (live, stale):
        os.utime(folder, (week_ago, week_ago))
    assert remove_dead_staging(str(tmp_path)) == [stale.name]
    assert live.is_dir() and not stale.exists()


def test_another_hosts_staging_folder_untouched_for_days_is_kept_until_a_week(tmp_path):
    """'not touched for 7 days' (the module docstring: a build suspended by Slurm's preemption over a weekend is
    still live): three days untouched is kept."""
    quiet = tmp_path / f"{STAGING_PREFIX}far-host-4026531836-14-0123abcd"
    quiet.mkdir()
    (quiet / "part.npy").write_bytes(b"\0" * 1000)
    three_days_ago = time.time() - 3 * 24 * 3600
    for path in (quiet / "part.npy", quiet):
        os.utime(path, (three_days_ago, three_days_ago))
    assert remove_dead_staging(str(tmp_path)) == []
    assert quiet.is_dir()


def test_a_failed_write_names_a_cache_file_not_the_staging_folder(tmp_path):
    """The staging folder could not be made (its OSError names the folder): the error names the cache file the
    build was about to write (the description, the first), not the staging folder's private name."""
    import errno

    from megatron_ext.data.index_caches import _failed_name

    staging = str(tmp_path / f"{STAGING_PREFIX}here-1-2-0123abcd")
    names = ["h-GPTDataset-train-description.txt", "h-GPTDataset-train-document_index.npy"]
    error = OSError(errno.ENOSPC, "No space left on device", staging)
    assert _failed_name(error, staging, names) == names[0]
    named = OSError(errno.ENOSPC, "No space left on device", os.path.join(staging, names[1]))
    assert _failed_name(named, staging, names) == names[1]
