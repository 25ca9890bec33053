"""Process environment from torchrun or Slurm variables."""

import pytest

from megatron_ext.runtime import first_host, process_env


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"),
    ("gpu[003-010,012]", "gpu003"),
    ("gpu[7],cpu1", "gpu7"),
    ("a-b-[01-02]", "a-b-01"),
    ("h100-n12,h100-n13", "h100-n12"),
    # several brackets, text after a bracket (the old parser gave rack1, n1)
    ("rack[1-2]-n[01-04],x", "rack1-n01"),
    ("n[1-2]-ib", "n1-ib"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "a[1-2", "a]1", "[]", "a[[1]]", ",a"])
def test_first_host_refuses_what_is_no_node_list(nodelist):
    with pytest.raises(ValueError, match="cannot parse Slurm node list"):
        first_host(nodelist)


def test_torchrun_env():
    e = process_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (3, 8, 1, "h", 1234, "torchrun")


def test_slurm_env():
    e = process_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                     "SLURM_JOB_NODELIST": "gpu[004-005]", "SLURM_JOB_ID": "123"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (9, 16, 1, "gpu004", "slurm")
    assert e.master_port == 20123
    # two steps of one allocation at once (salloc: two evaluations on a node) rendezvous on different ports
    steps = {process_env({"SLURM_JOB_ID": "123", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                          "SLURM_STEP_ID": str(i)}).master_port
             for i in range(4)}
    assert len(steps) == 4 and 20123 in steps
    # below the ephemeral ports (32768-60999) for any job id: one the kernel lent out could not be bound
    ports = [process_env({"SLURM_JOB_ID": str(j), "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                          "SLURM_STEP_ID": str(j % 5)}).master_port for j in range(0, 40000, 7)]
    assert 20000 <= min(ports) and max(ports) < 32768


def test_torchrun_wins_inside_slurm():
    e = process_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"})
    assert e.launcher == "torchrun" and e.rank == 1


def test_single_process():
    e = process_env({})
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the variable on a machine without CUDA")
@pytest.mark.parametrize("tensor, context, value", [(2, 1, "1"), (1, 4, "1"), (1, 1, None)])
def test_cuda_device_max_connections_before_cuda_starts(monkeypatch, tensor, context, value):
    """TP/CP overlap needs one CUDA hardware queue, read when the context is made: init_distributed sets it before
    it looks for a device (here it then stops: no CUDA), also under torchrun (the Slurm scripts set it too)."""
    import os

    from megatron_ext.runtime import DeviceError, init_distributed

    # setenv first: delenv of an absent variable records nothing to undo, and the value init_distributed writes
    # (os.environ directly) outlived the test, inherited by every process the suite started after it
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        init_distributed("cuda", tensor=tensor, context=context)
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == value
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # a user's own value is kept
    with pytest.raises(DeviceError):
        init_distributed("cuda", tensor=tensor, context=context)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_timeout_reaches_every_group(tmp_path):
    """runtime.timeout_minutes is the default group's timeout and that of Megatron's TP/PP/CP/DP groups (their own
    default is 30 minutes, so a save that outlasts it would still fail on them)."""
    import subprocess
    import sys

    code = """
import torch
from megatron.core import parallel_state as ps
from megatron_ext.runtime import destroy_distributed, init_distributed

def minutes(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60

for value in (7, 30):
    init_distributed("cpu", timeout_minutes=value)
    groups = [torch.distributed.group.WORLD, ps.get_tensor_model_parallel_group(),
              ps.get_pipeline_model_parallel_group(), ps.get_context_parallel_group(), ps.get_data_parallel_group()]
    print(value, [minutes(g) for g in groups])
    destroy_distributed()
"""
    from megatron_ext.runtime.job_env import free_port

    # a free port, not a fixed one: the suite's other pytest (tests/slurm) and its torchrun ranks and Slurm jobs pick
    # rendezvous ports in the same range, and a fixed one any of them holds failed this test with EADDRINUSE
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:-1] == ["7 [7.0, 7.0, 7.0, 7.0, 7.0]", "30 [30.0, 30.0, 30.0, 30.0, 30.0]"]


@pytest.mark.parametrize("environ, tasks", [
    ({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 8),
    ({"RANK": "3", "WORLD_SIZE": "16"}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x4)", "SLURM_NODEID": "3"}, 8),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "2"}, 2),
    ({"SLURM_TASKS_PER_NODE": "8,4", "SLURM_NODEID": "1"}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x4)"}, None),
    ({}, None),
])
def test_tasks_on_this_node(environ, tasks):
    from megatron_ext.runtime.distributed import tasks_on_this_node

    assert tasks_on_this_node(environ) == tasks


def test_two_ranks_never_share_a_gpu():
    """All GPUs per task (8 tasks, 8 GPUs: one each by local rank) or one per task (--gpus-per-task=1) are right;
    --gpu-bind=closest gives each task its NUMA domain's 4 GPUs, where local ranks 0 and 4 took the same one."""
    from megatron_ext.runtime import DeviceError
    from megatron_ext.runtime.distributed import gpu_of_local_rank

    assert [gpu_of_local_rank(r, 8, 8) for r in range(8)] == list(range(8))
    assert [gpu_of_local_rank(r, 1, 8) for r in range(8)] == [0] * 8
    assert gpu_of_local_rank(5, 8, None) == 5 and gpu_of_local_rank(1, 8, 4) == 1
    with pytest.raises(DeviceError, match=r"this task sees 4 GPUs .* and 8 tasks share the node: local rank 4 would "
                                          r"share GPU 0 with another task; .*--gpus-per-task=1"):
        gpu_of_local_rank(4, 4, 8)


def test_launcher_defaults_and_what_wins():
    """Hand-set variables: torchrun's defaults (LOCAL_RANK 0, 127.0.0.1:29500, torch's MASTER_PORT default); under
    Slurm the step's node list (an srun step on part of an allocation puts its task 0 on the step's first node, not
    the job's) and a MASTER_ADDR the job exported (slurm/common.sh vets it and lets it stand); a lone process keeps
    a MASTER_PORT it was given."""
    e = process_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert (e.local_rank, e.master_addr, e.master_port) == (0, "127.0.0.1", 29500)
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[001-004]", "SLURM_JOB_ID": "5"}
    assert process_env({**slurm, "SLURM_STEP_NODELIST": "gpu[003-004]"}).master_addr == "gpu003"
    assert process_env({**slurm, "MASTER_ADDR": "10.1.2.3"}).master_addr == "10.1.2.3"
    assert process_env({"MASTER_PORT": "23456"}).master_port == 23456
    # consecutive job ids are the common neighbours on a shared node: job N's second step and job N+1's first
    # must not meet on one port
    assert (process_env({**slurm, "SLURM_JOB_ID": "123", "SLURM_STEP_ID": "1"}).master_port
            != process_env({**slurm, "SLURM_JOB_ID": "124", "SLURM_STEP_ID": "0"}).master_port)


@pytest.mark.parametrize("environ, tasks", [
    # an srun step inside the allocation (1 task per node in a job of 8 per node): the step's layout, not the job's
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}, 1),
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "2"}, None),  # a node the list does not reach: no guess
])
def test_tasks_on_this_node_of_a_step(environ, tasks):
    from megatron_ext.runtime.distributed import tasks_on_this_node

    assert tasks_on_this_node(environ) == tasks


def test_rank_zero_outcome_without_a_process_group():
    """The caller is rank 0: a value comes back, an expected error as its message, any other error raised as it is
    (checkpoint_space reads only the value: a message in its place would pass a failed check as no verdict)."""
    from megatron_ext.runtime.distributed import rank_zero_outcome

    def fails(error):
        raise error

    assert rank_zero_outcome(lambda: 7, KeyError) == (7, None)
    assert rank_zero_outcome(lambda: fails(KeyError("k")), KeyError) == (None, "'k'")
    with pytest.raises(ValueError, match="^bad$"):
        rank_zero_outcome(lambda: fails(ValueError("bad")), KeyError)


def test_shared_gpu_refused_before_the_device_is_taken(monkeypatch):
    """init_distributed passes the node's task count to gpu_of_local_rank: 8 tasks on a node that each see 4 GPUs
    (--gpu-bind=closest) is a DeviceError before any GPU is taken. No machine here has several GPUs: torch.cuda's
    count is stood in for (the refusal comes before anything else of CUDA is touched)."""
    import torch

    from megatron_ext.runtime import DeviceError, init_distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_PROCID": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "4", "SLURM_NODEID": "0",
                        "SLURM_STEP_TASKS_PER_NODE": "8"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(DeviceError, match="8 tasks share the node: local rank 4 would share GPU 0"):
        init_distributed("cuda")


def test_two_nodes_one_task_each_take_their_global_ranks(tmp_path):
    """Slurm tasks on two nodes, one each: both have SLURM_LOCALID 0, SLURM_PROCID 0 and 1. The default group takes
    the global rank (by the local one both would be rank 0: a rendezvous that never completes). Real gloo, two
    processes; the all-reduce sums 1 + 2."""
    import os
    import subprocess
    import sys

    from megatron_ext.runtime.job_env import free_port

    code = """
import torch
from megatron_ext.runtime import destroy_distributed, init_distributed
penv = init_distributed("cpu", timeout_minutes=1)
t = torch.tensor([penv.rank + 1.0])
torch.distributed.all_reduce(t)
print(torch.distributed.get_rank(), torch.distributed.get_world_size(), penv.local_rank, t.item())
destroy_distributed()
"""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") and not k.startswith("SLURM_")}
    # this tree's megatron_ext, not whichever the interpreter has installed
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURM_NTASKS="2", SLURM_LOCALID="0",
                SLURM_JOB_NODELIST="127.0.0.1", PYTHONPATH=os.pathsep.join(filter(None, [root, base.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**base, "SLURM_PROCID": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-2000:]
        assert out.splitlines()[-1] == f"{r} 2 0 3.0"


def test_port_in_use_names_the_fix_for_each_launcher():
    from megatron_ext.runtime import ProcessEnv
    from megatron_ext.runtime.distributed import port_in_use

    def said(launcher):
        return port_in_use(ProcessEnv(0, 8, 0, "gpu004", 20123, launcher))

    assert said("single") == ("rendezvous port gpu004:20123 (MASTER_PORT) is in use by another process; unset "
                              "MASTER_PORT (a free port is then chosen) or export a free one")
    assert said("torchrun").endswith("; give torchrun another --master_port")
    assert "export MASTER_PORT=<a free port below 32768> before srun" in said("slurm")


def test_a_group_leaves_its_port_out_of_the_environment_of_later_programs():
    """A test suite (tests/gpu) made a group in its own process, destroyed it, then started the trainer and the
    converter: they read the MASTER_PORT init_distributed had exported, which the suite's store still held, and
    failed with EADDRINUSE. Now the port goes in init_method only; a program started after picks its own."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = """
import os, subprocess, sys
from megatron_ext.runtime import destroy_distributed, init_distributed
init_distributed("cpu")
destroy_distributed()
print("exported:", os.environ.get("MASTER_PORT"))
child = "from megatron_ext.runtime import init_distributed; init_distributed('cpu'); print('child ok')"
proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
print(proc.stdout.strip(), proc.returncode)
print(proc.stderr[-300:], file=sys.stderr)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["exported: None", "child ok 0"], proc.stdout + proc.stderr[-2000:]
