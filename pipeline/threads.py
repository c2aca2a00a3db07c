"""A rank's CPU threads: one rule under every launcher (vitp's own, submitit's local executor, SLURM,
torchrun), so one command gives the same bits under each. Ground floor: imports torch only."""

from __future__ import annotations

import os

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def use_cpu_threads(n: int, environ=None) -> str | None:
    """Give this rank ``n`` CPU threads (cluster.cpus_per_task): torch's intra-op pool (its fp32 sums
    split by thread count, so it decides a CPU run's last bits), its inter-op pool where still unset,
    and THREAD_VARS for the processes the rank starts. Loader workers take 1 each (data/workers.py).

    The config wins over an OMP_NUM_THREADS in the environment: torchrun puts 1 there for every rank
    it starts, a SLURM task or submitit's local executor nothing, and inside the rank a user's value
    cannot be told from a launcher's. Returns a note when the environment said otherwise, else None.
    """
    import torch

    env = os.environ if environ is None else environ
    before = env.get("OMP_NUM_THREADS")
    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # settable once per process; eager ops never run on the inter-op pool
            pass
    env.update({var: str(n) for var in THREAD_VARS})
    if before is None or before == str(n):
        return None
    return (f"note: {n} CPU thread(s) per rank from cluster.cpus_per_task (OMP_NUM_THREADS={before} from "
            "the environment is not used: set cluster.cpus_per_task)")
