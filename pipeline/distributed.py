"""Rank, world and rendezvous from the environment: a launcher's (torchrun, deepspeed, vitp local)
or SLURM's. Stages call :func:`dist_env` and never care which one started them.

Rank-0 side effects (printing, progress) go through :func:`rank0_print`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"  # "env" (a launcher set RANK/WORLD_SIZE), "slurm" or "single"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist ("node[1-2]" → "node1"); scontrol knows every syntax."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def dist_env(environ: dict | None = None) -> DistEnv:
    """Read rank/world/master from a launcher's env vars, else SLURM's, else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)), source="env")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        ntasks = int(env["SLURM_NTASKS"])
        nnodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", 1)))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or max(1, ntasks // nnodes))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=ntasks,
            local_rank=int(env.get("SLURM_LOCALID", 0)), local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT") or rendezvous_port(env.get("SLURM_JOB_ID", "0"),
                                                                       int(env.get("SLURM_RESTART_COUNT") or 0))),
            source="slurm")
    return DistEnv()


def export_env(d: DistEnv) -> None:
    """Set the torch.distributed variables so any library (DeepSpeed) sees the same rendezvous."""
    os.environ.update({
        "RANK": str(d.rank), "WORLD_SIZE": str(d.world_size), "LOCAL_RANK": str(d.local_rank),
        "LOCAL_WORLD_SIZE": str(d.local_world_size), "MASTER_ADDR": d.master_addr,
        "MASTER_PORT": str(d.master_port),
    })


def rank0_print(*args, file=None, **kwargs) -> None:
    """Print only on global rank 0 (the one helper for rank-0 console output)."""
    if dist_env().is_rank0:
        print(*args, file=file or sys.stdout, flush=True, **kwargs)


# --------------------------------------------------------------------------------------------------
# Rendezvous: fail fast and say why, instead of hanging until the scheduler's time limit.
# --------------------------------------------------------------------------------------------------
class RendezvousError(RuntimeError):
    """The ranks could not meet (port taken, a rank never arrived); the message is one line."""


def rendezvous_port(job_id: str, restart: int = 0) -> int:
    """A port every task of a job derives alone; a requeued job (restart > 0) gets a fresh one,
    so a socket of the previous attempt lingering in TIME_WAIT cannot clash."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return 20000 + (int(digits) * 7 + restart) % 20000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for single-node rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "") -> bool:
    """True when ``port`` can be bound here (SO_REUSEADDR, like torch's TCPStore server)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def default_backend(backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def leave_process_group() -> None:
    """Destroy the default process group, if any, once a rank's work is done.

    A gloo rank that exits with its group alive can abort during interpreter teardown (its C++
    worker threads are still joinable: "terminate called without an active exception", exit -6),
    turning a finished job into a failed one. Call it where every rank ends the same way (a normal
    return, or an error all ranks agreed on): a rank still inside a collective can make it hang.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def init_process_group(d: DistEnv, backend: str = "auto", timeout_s: float = 300) -> bool:
    """Join the process group described by ``d`` within ``timeout_s`` or raise RendezvousError.

    Done before DeepSpeed starts (DeepSpeed then reuses the group). Returns False when there is
    nothing to join (one rank, or a group already exists).
    """
    import datetime

    import torch.distributed as dist

    if d.world_size <= 1 or dist.is_initialized():
        return False
    where = f"{d.master_addr}:{d.master_port}"
    if d.is_rank0 and not port_free(d.master_port):
        raise RendezvousError(
            f"rendezvous port {d.master_port} on {d.master_addr} is already in use; "
            f"set MASTER_PORT to a free port or resubmit")
    try:
        dist.init_process_group(
            default_backend(backend), init_method=f"tcp://{where}", rank=d.rank,
            world_size=d.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistStoreError/DistNetworkError/RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        who = "waiting for the other ranks" if d.is_rank0 else f"connecting to rank 0 at {where}"
        raise RendezvousError(
            f"rank {d.rank}/{d.world_size}: rendezvous at {where} failed after {timeout_s:g}s "
            f"{who} ({first}); engine.dist_timeout_s sets the limit") from None
    return True
