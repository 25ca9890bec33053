"""Where this process sits in a job, from torchrun's or Slurm's variables, read without torch (the tools' argument
checks and error lines use it before torch is imported)."""

from __future__ import annotations

import os
import random
import re
import socket
from dataclasses import dataclass
from typing import Mapping


class DeviceError(RuntimeError):
    """The device a run asks for is not what this process can use (no GPU visible, or GPUs for a CPU run)."""


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def first_host(nodelist: str) -> str:
    """First host name of a Slurm node list, where Slurm puts rank 0: `gpu[003-010,012],cpu1` -> `gpu003`,
    `rack[1-2]-n[01-04]` -> `rack1-n01`, `n[1-2]-ib` -> `n1-ib` (each bracket gives its first value)."""
    nodelist = nodelist.strip()
    entry = re.match(r"(?:[^,\[\]]|\[[^\[\]]*\])*", nodelist).group(0)  # up to the first comma outside brackets
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], entry)
    if not host or nodelist[len(entry):len(entry) + 1] not in ("", ","):
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    return host


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free local TCP port for a rendezvous that another process binds later, below Linux's ephemeral range
    (32768-60999): a port the kernel handed out (bind to 0) could be handed to any other process's connection or
    listener again before ours binds it, seconds later (EADDRINUSE, seen with gloo's many sockets beside)."""
    pick = random.SystemRandom()  # not the global generator: processes that seeded it alike would pick alike
    for _ in range(200):
        port = pick.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port between {low} and {high}")


def process_env(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """Read rank/world/rendezvous from torchrun (`RANK`...) or Slurm (`SLURM_PROCID`...) variables.

    torchrun's variables win when both are present (torchrun inside an sbatch job).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        # A port derived from the job and step ids lets every task agree without talking; jobs sharing a node get
        # different ports, and so do two steps of one allocation running at once (salloc, two evaluations).
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        step_id = int(env.get("SLURM_STEP_ID", "0") or 0) if env.get("SLURM_STEP_ID", "").isdigit() else 0
        return ProcessEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            # per job (jobs may share a node), below Linux's ephemeral ports (32768-60999) as free_port's
            master_port=int(env.get("MASTER_PORT") or 20000 + (job_id + 1009 * step_id) % 12000),
            launcher="slurm",
        )
    return ProcessEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT") or free_port()), "single")
