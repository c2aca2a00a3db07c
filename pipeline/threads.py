"""A rank's CPU: its threads, one rule under every launcher (vitp's own, submitit's local executor,
SLURM, torchrun), so one command gives the same bits under each; and its host allocator, held steady so
a step costs the same from one process to the next. Ground floor: imports torch only."""

from __future__ import annotations

import ctypes
import ctypes.util
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


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 * 2**20  # blocks above this still come from (and go back to) the kernel
TRIM_THRESHOLD = 2**30  # free memory at the heap's top kept for the next step, up to this much
ALLOCATOR_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # and GLIBC_TUNABLES' glibc.malloc.*


def steady_allocator(environ=None) -> bool:
    """Keep the memory a step frees for the next step (glibc's malloc; elsewhere nothing is done).

    By default glibc hands every block above a threshold back to the kernel when it is freed (munmap)
    and trims the heap's free top, and it moves that threshold as it sees blocks freed. A CPU step
    allocates and frees tens of activation tensors of megabytes each; where one lands (heap or a fresh
    mapping) depends on the process's allocation history, and each fresh page is a fault that the
    kernel zero-fills. Measured on a ViT-S/16 CPU step (batch 8, 2 threads): 35k-78k page faults per
    step, the same model's median step 1.0 s in one process and 1.4-2.0 s in others, single steps up
    to 4.6 s; with both thresholds fixed, no fault after the first steps.
    The thresholds are fixed (which also stops glibc moving them): blocks up to MMAP_THRESHOLD come
    from the heap and freed memory stays there, up to TRIM_THRESHOLD at its top. A user's own setting
    (ALLOCATOR_VARS or a malloc tunable in the environment) is left as it is. Returns whether the thresholds were set.
    """
    env = os.environ if environ is None else environ
    if any(v in env for v in ALLOCATOR_VARS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator is left alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # an older glibc caps the mmap threshold at 32 MiB: the largest it takes still stops it moving
    if not any(mallopt(M_MMAP_THRESHOLD, n) for n in (MMAP_THRESHOLD, 32 * 2**20)):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
