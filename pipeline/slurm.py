"""The SLURM facts a job reads about itself, in one place: which attempt this is, why it got SIGTERM,
and asking for a requeue (with nodes left out). Library and launcher both read them (the library may
not import launch/)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from pipeline.stops import Stop


def restart_count(environ=None) -> int:
    """SLURM_RESTART_COUNT: 0 for the first attempt, n for the n-th requeue (unset outside SLURM: 0)."""
    env = os.environ if environ is None else environ
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def requeue(job_id: str) -> None:
    """``scontrol requeue``: the job ends now and comes back under the same id (restart count + 1)."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    print(f"Requeued job {job_id} (restart {restart_count() + 1})", file=sys.stderr, flush=True)


def requeue_excluding(job_id: str, nodes: list[str], run=subprocess.run) -> bool:
    """Requeue job ``job_id`` with ExcNodeList=``nodes`` (all of them: the update replaces the list);
    :func:`requeue_as`. -> whether the update took."""
    return requeue_as(job_id, exclude=nodes, run=run)


def requeue_as(job_id: str, *, exclude: list[str] | None = None, nodes: int | None = None, tasks_per_node: int = 1,
               run=subprocess.run) -> bool:
    """Requeue job ``job_id`` changed: ExcNodeList=``exclude`` (the update replaces the list) and/or
    NumNodes=``nodes`` with ``nodes x tasks_per_node`` tasks (an elastic job's next attempt, cluster.min_nodes).

    SLURM 22.05 refuses ExcNodeList for a job that is not PENDING (job_mgr.c ``_update_job``:
    ESLURM_JOB_NOT_PENDING), and NumNodes on a running job would shrink its allocation, so:
    ``scontrol requeuehold`` (the job is PENDING at once, held so that no scheduler pass starts it before
    the update), ``scontrol update``, ``scontrol release``. A job SLURM requeued by itself (its node
    failed) is pending already: ``hold`` instead. The requeue kills the calling batch script (SIGTERM,
    KillWait, SIGKILL), so SIGTERM is ignored until the release is sent.
    -> whether the update took (a refused one is reported; the job is released either way)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the scontrol children too
    held = run(["scontrol", "requeuehold", job_id], capture_output=True, text=True, timeout=60)
    if held.returncode and "pending" in (held.stderr or "").lower():
        held = run(["scontrol", "hold", job_id], capture_output=True, text=True, timeout=60)
    if held.returncode:
        raise subprocess.CalledProcessError(held.returncode, held.args, held.stdout, held.stderr)
    fields = [f"ExcNodeList={','.join(exclude)}"] if exclude is not None else []
    if nodes is not None:  # NumTasks too: SLURM keeps the submitted task count, which would pin the node count
        fields += [f"NumNodes={nodes}", f"NumTasks={nodes * tasks_per_node}"]
    try:
        upd = run(["scontrol", "update", f"JobId={job_id}", *fields], capture_output=True, text=True, timeout=60)
        if upd.returncode:
            print(f"vitp: job {job_id}: {' '.join(fields)} refused ({(upd.stderr or '').strip()})",
                  file=sys.stderr, flush=True)
    finally:
        run(["scontrol", "release", job_id], check=True, capture_output=True, text=True, timeout=60)
    how = [f"without {','.join(exclude)}"] if exclude else []
    how += [f"on {nodes} node(s)"] if nodes is not None else []
    print(f"Requeued job {job_id} (restart {restart_count() + 1}) {' '.join(how)}".rstrip(), file=sys.stderr,
          flush=True)
    return upd.returncode == 0


def parse_term_cause(scontrol_text: str, restart: int = 0) -> Stop:
    """`scontrol show job -o JOBID` at SIGTERM time, in attempt ``restart`` -> PREEMPT | TIME_LIMIT | LOST |
    CANCEL.

    Measured on SLURM 22.05: a job preempted with PreemptMode=REQUEUE gets TERM while it is still
    RUNNING with PreemptTime set (the grace period); a scancel'd job is already COMPLETING (or CANCELLED)
    with PreemptTime=None; a requeued attempt starts with PreemptTime=None again. A job SLURM requeued
    itself (NODE_FAIL: a node of it went down; or an admin's ``scontrol requeue``) is COMPLETING with
    Restarts already past this attempt's: it comes back, so its TERM is no cancel."""
    fields = dict(kv.split("=", 1) for kv in scontrol_text.split() if "=" in kv)
    state = fields.get("JobState", "")
    if state == "RUNNING" and fields.get("PreemptTime", "None") not in ("None", "Unknown", "(null)", ""):
        return Stop.PREEMPT
    if state.startswith("TIMEOUT"):
        return Stop.TIME_LIMIT
    if int(fields.get("Restarts", "0") or 0) > restart:
        return Stop.LOST
    return Stop.CANCEL


def term_cause(job_id: str) -> Stop:
    """Why job ``job_id`` got SIGTERM, asked of SLURM; anything unclear is a cancel (a user's scancel
    must never requeue)."""
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return Stop.CANCEL
    return parse_term_cause(r.stdout, restart_count()) if r.returncode == 0 else Stop.CANCEL
