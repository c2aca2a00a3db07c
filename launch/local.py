"""Run a `vitp` command as N local processes (the multi-rank CPU runs of tests and the demo).

Each process gets the torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port) and DS_ACCELERATOR=cpu when there is no GPU; no thread
count: a stage takes its own from cluster.cpus_per_task (pipeline.distributed.setup), as under any
launcher. If one rank fails or is killed, the others get SIGTERM, then SIGKILL after STOP_GRACE_S
(a rank waiting in a collective that does not fail would hang until its timeout), and that rank's
exit code is returned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.network import free_port

ROOT = Path(__file__).resolve().parents[1]
# After one rank failed (or the timeout): SIGTERM the others, SIGKILL what is left this much later.
# A rank takes SIGTERM as a stop request (launch/stages.py): it saves at its step boundary or fails in
# its next collective, and on the way out delivers its tracking records (10 s at most, tracking.py).
STOP_GRACE_S = 30


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_local(argv: list[str], nprocs: int, *, env: dict | None = None, timeout: float | None = None,
              module: str = "launch.cli", log: str | os.PathLike | None = None) -> int:
    """Run ``python -m MODULE *argv`` (the vitp command line by default) as ``nprocs`` ranks; 0 if all
    succeed, else the first failure's code (negative: killed by that signal; 124: ``timeout`` seconds
    passed). ``log``: the ranks' stdout and stderr are appended to this file instead of this process's."""
    base = dict(os.environ)
    base.update(env or {})
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs))
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    if not _has_cuda():
        base.setdefault("DS_ACCELERATOR", "cpu")
    procs = []
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 (closed below, after the ranks)
    for r in range(nprocs):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=e, cwd=os.getcwd(), stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                code = 124
                break
            time.sleep(0.2)  # polling a handful of children; not synchronisation of results
    finally:
        _stop_all(procs)
        if out is not None:
            out.close()
    return code


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    t = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, t - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
