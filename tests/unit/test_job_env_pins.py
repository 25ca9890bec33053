"""Pins of megatron_ext.runtime.job_env found by mutation audit round 9: which launcher a half-set environment is
taken for, the rendezvous address and port each launcher gives (a MASTER_PORT the job exported wins under Slurm too;
an empty or non-numeric Slurm id does not crash), and free_port's range, retries and independence from the global
random generator (checked against real sockets, the kernel's EADDRINUSE the oracle)."""

from __future__ import annotations

import random
import socket

import pytest

from megatron_ext.runtime import first_host, free_port, process_env

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_ID": "5"}


def test_a_node_list_with_surrounding_whitespace():
    """A node list read from a file or a command's output (a trailing newline) gives the bare host name."""
    assert first_host("  gpu[003-004],cpu1\n") == "gpu003"


@pytest.mark.parametrize("environ, launcher", [
    ({"RANK": "1"}, "single"),  # RANK alone (a stray export): no torchrun world
    ({"RANK": "1", **SLURM}, "slurm"),
    ({"SLURM_PROCID": "1"}, "single"),  # SLURM_PROCID without SLURM_NTASKS
    ({"SLURM_PROCID": "1", "WORLD_SIZE": "4"}, "single"),
])
def test_a_half_set_launcher_is_not_taken_for_one(environ, launcher):
    """torchrun needs RANK and WORLD_SIZE, Slurm SLURM_PROCID and SLURM_NTASKS; one of a pair alone was a KeyError
    on the other (mutants JE7, JE9)."""
    assert process_env(environ).launcher == launcher


def test_slurm_defaults_and_a_master_port_the_job_exported():
    """Under Slurm: a MASTER_PORT the job exported wins over the derived one, as MASTER_ADDR does (JE15); without a
    node list the rendezvous is on 127.0.0.1 (JE10); SLURM_LOCALID missing is local rank 0, as torchrun's default
    (JE14); an empty SLURM_JOB_ID is job 0 and a non-numeric SLURM_STEP_ID step 0, not a ValueError (JE11, JE12)."""
    assert process_env({**SLURM, "MASTER_PORT": "23456"}).master_port == 23456
    e = process_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (3, 4, 0, "127.0.0.1", "slurm")
    assert (process_env({**SLURM, "SLURM_JOB_ID": ""}).master_port
            == process_env({**SLURM, "SLURM_JOB_ID": "0"}).master_port)
    assert (process_env({**SLURM, "SLURM_STEP_ID": "batch"}).master_port
            == process_env({**SLURM, "SLURM_STEP_ID": "0"}).master_port)


def test_slurm_ports_stay_in_free_ports_range():
    """The port derived from the job and step ids lies in free_port's range (20000-32000), below the ephemeral ports
    (JE13: a wider modulus reached 32767)."""
    ports = {process_env({**SLURM, "SLURM_JOB_ID": str(j), "SLURM_STEP_ID": str(s)}).master_port
             for j in range(11000, 13000, 13) for s in range(3)}
    assert min(ports) >= 20000 and max(ports) <= 32000


def test_a_lone_process_rendezvous_on_loopback():
    """A single process keeps its store on 127.0.0.1 whatever MASTER_ADDR a shell left exported (JE17)."""
    assert process_env({"MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "23456"}).master_addr == "127.0.0.1"


def test_free_port_range():
    """Ports below Linux's ephemeral range by default (JE5: up to 60999)."""
    assert all(20000 <= free_port() <= 32000 for _ in range(200))


def test_free_port_ignores_the_global_random_seed():
    """Processes that seeded `random` alike (every rank with the same seed) still pick apart (JE4)."""
    picks = []
    for _ in range(4):
        random.seed(1234)
        picks.append(free_port())
    assert len(set(picks)) > 1


def test_free_port_skips_a_busy_port_and_says_when_all_are():
    """A port another socket holds on 127.0.0.1 is skipped and the free one found (JE6: the bind error raised; JE18:
    one try only; JE19: checked on another address, the busy port returned); with none free, one OSError naming
    the range."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"no free TCP port between {port} and {port}"):
            free_port(port, port)
        for other in (port + 1, port - 1):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", other))
                except OSError:
                    continue  # taken by something else: try the other neighbour
            low, high = sorted((port, other))
            assert {free_port(low, high) for _ in range(20)} == {other}
            return
        pytest.skip("both neighbours of the busy port are taken")
