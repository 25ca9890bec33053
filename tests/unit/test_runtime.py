"""Process environment from torchrun or Slurm variables."""

import pytest

from megatron_ext.runtime import first_host, process_env


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"),
    ("gpu[003-010,012]", "gpu003"),
    ("gpu[7],cpu1", "gpu7"),
    ("a-b-[01-02]", "a-b-01"),
    ("h100-n12,h100-n13", "h100-n12"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_torchrun_env():
    e = process_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (3, 8, 1, "h", 1234, "torchrun")


def test_slurm_env():
    e = process_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                     "SLURM_JOB_NODELIST": "gpu[004-005]", "SLURM_JOB_ID": "123"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (9, 16, 1, "gpu004", "slurm")
    assert e.master_port == 15123


def test_torchrun_wins_inside_slurm():
    e = process_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"})
    assert e.launcher == "torchrun" and e.rank == 1


def test_single_process():
    e = process_env({})
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single")
