"""torch's CUDA build against a node's NVIDIA driver: the one table of minimum drivers, and how a
node's driver is read. A torch built for CUDA 13.0 on a node with driver 535 cannot start a single
rank; `vitp submit` (a probe on the partition) and `vitp preflight` (every node) say so in one line
before the big job holds its GPUs.

NVIDIA's documented minimums for Linux x86_64 with minor-version compatibility (CUDA 11 and later:
any toolkit of a major release runs on that major's first driver; CUDA Toolkit release notes, "CUDA
Driver" table, and the CUDA Compatibility guide). Within a major, features that need a newer driver
(PTX JIT of a newer ISA) fail at use, not at start; vitp ships no PTX of its own.

    python -m pipeline.driver        # this node, as JSON: {"host", "torch_cuda", "driver", "problem"}
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

# CUDA major -> minimum Linux driver (as a version tuple) under minor-version compatibility
MIN_DRIVER: dict[int, tuple[int, ...]] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580,),
}

# Tests only: a torch whose CUDA build is this version (CPU machines have no CUDA build to check).
FAKE_TORCH_CUDA_ENV = "VITP_TEST_TORCH_CUDA"


def parse_version(text: str) -> tuple[int, ...]:
    """'535.104.05' -> (535, 104, 5); '13.0' -> (13, 0). ValueError on anything else."""
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in parts)


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(f"{x:02d}" if i == 2 else str(x) for i, x in enumerate(v))


def min_driver(cuda: str) -> tuple[int, ...] | None:
    """The minimum driver for a CUDA build ('12.4' -> (525, 60, 13)); None for an unknown major."""
    return MIN_DRIVER.get(parse_version(cuda)[0])


def driver_problem(torch_cuda: str | None, driver: str | None, where: str = "this node") -> str | None:
    """None when a torch built for ``torch_cuda`` can run on ``driver``, else one line naming both.

    ``torch_cuda`` None is a CPU build; ``driver`` None means no NVIDIA driver was found.
    """
    if torch_cuda is None:
        return "torch is a CPU-only build (no CUDA)"
    if driver is None:
        return f"torch is built for CUDA {torch_cuda} but {where} has no NVIDIA driver (nvidia-smi not found)"
    need = min_driver(torch_cuda)
    try:
        have = parse_version(driver)
    except ValueError:
        return f"{where}: cannot read the NVIDIA driver version from {driver!r}"
    if need is not None and have < need:
        return (f"torch is built for CUDA {torch_cuda}, which needs an NVIDIA driver >= {_dotted(need)}, but "
                f"{where} has driver {driver}")
    return None


def torch_cuda() -> str | None:
    """The CUDA version this process's torch was built for (None: a CPU build)."""
    fake = os.environ.get(FAKE_TORCH_CUDA_ENV)
    if fake:
        return fake
    import torch

    return torch.version.cuda


def node_driver(timeout_s: float = 30) -> str | None:
    """This node's NVIDIA driver version, or None without one.

    nvidia-smi first (what a user would run); where it lists no device (a job step granted no GPU
    under cgroup device limits) the kernel module's version, which needs no device.
    """
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=timeout_s)
        lines = [x.strip() for x in r.stdout.splitlines() if x.strip()]
        if r.returncode == 0 and lines:
            return lines[0]
    except (OSError, subprocess.SubprocessError):
        pass
    for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
        try:
            text = open(path).read()
        except OSError:
            continue
        words = [w for w in text.split() if w[:1].isdigit() and "." in w]
        if words:
            return words[0]
    return None


def probe() -> dict:
    """This node's answer: host, torch's CUDA build, the driver, and the problem (None when they fit)."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    cuda, drv = torch_cuda(), node_driver()
    problem = driver_problem(cuda, drv, where=host) if cuda is not None else None
    return {"host": host, "torch_cuda": cuda, "driver": drv, "problem": problem}


if __name__ == "__main__":
    print(json.dumps(probe()))
    sys.exit(0)
