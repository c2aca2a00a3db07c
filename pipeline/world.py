"""Where this process stands in its job: rank, world size and local rank, as the launcher that started
it wrote them into the environment (torch-free, standard library only). The one reader of those
variables; :func:`pipeline.distributed.dist_env` (the rendezvous), the config's world check
(:func:`pipeline.config.stages.world_size_from_env`) and the submitit job body ask it.

Launchers, each a set of variables:
    LAUNCHER        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (LOCAL_SIZE): torchrun, deepspeed,
                    vitp's local launcher, and every stage once pipeline.distributed.export_env ran
    SLURM           SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE: an srun task
                    (what submitit's slurm JobEnvironment reads)
    SUBMITIT_LOCAL  SUBMITIT_LOCAL_GLOBALID, _NTASKS, _LOCALID: submitit's local executor

The caller says which launchers count: a job started by submitit reads its own executor's; the config
check of `vitp submit` reads only LAUNCHER's (run inside an salloc/sbatch shell, SLURM_NTASKS is that
shell's allocation, not the job being submitted, which runs on the planned world).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

LAUNCHER, SLURM, SUBMITIT_LOCAL = "env", "slurm", "local"


@dataclass(frozen=True)
class Place:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    source: str = "single"  # the launcher whose variables said so: LAUNCHER, SLURM, SUBMITIT_LOCAL, or "single"


def _launcher(env: Mapping[str, str]) -> Place | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return Place(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                 int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", 1))), LAUNCHER)  # LOCAL_SIZE: deepspeed's


def _slurm(env: Mapping[str, str]) -> Place | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    ntasks = int(env["SLURM_NTASKS"])
    nnodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", 1)))
    # "4(x2)": 4 tasks on each of 2 nodes; without it, tasks spread evenly
    per_node = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0].split(",")[0] or max(1, ntasks // nnodes))
    return Place(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)), per_node, SLURM)


def _submitit_local(env: Mapping[str, str]) -> Place | None:
    if "SUBMITIT_LOCAL_GLOBALID" not in env or "SUBMITIT_LOCAL_NTASKS" not in env:
        return None
    ntasks = int(env["SUBMITIT_LOCAL_NTASKS"])
    nnodes = int(env.get("SUBMITIT_LOCAL_JOB_NUM_NODES", 1))
    return Place(int(env["SUBMITIT_LOCAL_GLOBALID"]), ntasks, int(env.get("SUBMITIT_LOCAL_LOCALID", 0)),
                 max(1, ntasks // nnodes), SUBMITIT_LOCAL)


READERS: dict[str, Callable[[Mapping[str, str]], Place | None]] = {
    LAUNCHER: _launcher, SLURM: _slurm, SUBMITIT_LOCAL: _submitit_local}


def place(environ: Mapping[str, str] | None = None, *, launchers: Sequence[str] = (LAUNCHER, SLURM)) -> Place:
    """This process's place as the first of ``launchers`` whose variables are set says (a launcher's
    win over SLURM's by default: torchrun inside an allocation); a single process when none is.
    An unknown launcher name (submitit's debug executor) counts as none."""
    env = os.environ if environ is None else environ
    for name in launchers:
        reader = READERS.get(name)
        found = reader(env) if reader is not None else None
        if found is not None:
            return found
    return Place()
