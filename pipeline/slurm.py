"""The SLURM facts a job reads about itself, in one place: which attempt this is, why it got SIGTERM,
and asking for a requeue. Library and launcher both read them (the library may not import launch/)."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.stops import Stop


def restart_count(environ=None) -> int:
    """SLURM_RESTART_COUNT: 0 for the first attempt, n for the n-th requeue (unset outside SLURM: 0)."""
    env = os.environ if environ is None else environ
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def requeue(job_id: str) -> None:
    """``scontrol requeue``: the job ends now and comes back under the same id (restart count + 1)."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    print(f"Requeued job {job_id} (restart {restart_count() + 1})", file=sys.stderr, flush=True)


def parse_term_cause(scontrol_text: str) -> Stop:
    """`scontrol show job -o JOBID` at SIGTERM time -> PREEMPT | TIME_LIMIT | CANCEL.

    Measured on SLURM 22.05: a job preempted with PreemptMode=REQUEUE gets TERM while it is still
    RUNNING with PreemptTime set (the grace period); a scancel'd job is already COMPLETING (or CANCELLED)
    with PreemptTime=None; a requeued attempt starts with PreemptTime=None again."""
    fields = dict(kv.split("=", 1) for kv in scontrol_text.split() if "=" in kv)
    state = fields.get("JobState", "")
    if state == "RUNNING" and fields.get("PreemptTime", "None") not in ("None", "Unknown", "(null)", ""):
        return Stop.PREEMPT
    if state.startswith("TIMEOUT"):
        return Stop.TIME_LIMIT
    return Stop.CANCEL


def term_cause(job_id: str) -> Stop:
    """Why job ``job_id`` got SIGTERM, asked of SLURM; anything unclear is a cancel (a user's scancel
    must never requeue)."""
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return Stop.CANCEL
    return parse_term_cause(r.stdout) if r.returncode == 0 else Stop.CANCEL
