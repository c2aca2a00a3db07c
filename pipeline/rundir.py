"""One job at a time in a run dir: ``RUN_DIR/.owner.json`` names the job that trains there.

"Resume = submit the same command again" invites submitting it while the first job still runs or is
still queued; two jobs in one run dir would both write its checkpoints and metrics. So a stage first
claims the run dir (rank 0, before anything in it is read or written) and every rank learns the verdict:
a second job refuses with one line naming the run dir and the owner, and changes nothing there.

A claim never outlives its owner for long, without anyone cleaning up:
- the owner is a SLURM job (``job``) that squeue lists as pending/running → busy. A requeued attempt of
  that job (same job id, higher ``restart``) takes the claim over, and while the job waits in the queue
  after a preemption or a failure, the run dir stays its own;
- the owner ran on this host → busy while its process (pid and start time) lives;
- otherwise (another host, no SLURM to ask) → busy while its heartbeat is fresh: the owner touches the
  file every ``lease/4`` seconds; a claim not touched for ``lease`` seconds (VITP_RUNDIR_LEASE_S,
  default 60) belonged to a process that died.

Taking over a dead owner's claim is atomic: the stale file is renamed away (only one claimant's rename
succeeds) and the new claim is hard-linked into place (``link`` fails if the name exists, also on NFS).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from pipeline import slurm
from pipeline.errors import Classified

OWNER = ".owner.json"
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


class RunDirBusy(Classified, RuntimeError):
    """Another live job owns the run dir."""

    exit_code = 2
    retry = False


def lease_s() -> float:
    return float(os.environ.get("VITP_RUNDIR_LEASE_S", "60"))


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, it
    names one process even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def me(environ: dict | None = None) -> dict:
    """This process as an owner record."""
    env = os.environ if environ is None else environ
    return {"job": env.get("SLURM_JOB_ID") or None, "restart": slurm.restart_count(env),
            "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(os.getpid()),
            "since": time.time()}


def slurm_state(job: str) -> str | None:
    """squeue's state of ``job``; "" when squeue answers without it (ended); None when it cannot be asked."""
    if shutil.which("squeue") is None:
        return None
    try:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:  # "Invalid job id specified": the job has ended and been purged
        return "" if "Invalid job id" in r.stderr else None
    return r.stdout.strip().split("\n")[0].strip().upper()


def _pid_alive(owner: dict) -> bool:
    pid = int(owner.get("pid") or 0)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    start = _proc_start(pid)
    return start is None or owner.get("pid_start") in (None, start)


def owner_alive(owner: dict, mine: dict, beat: float, now: float | None = None) -> tuple[bool, str]:
    """(whether ``owner`` still holds the run dir, its state in words) as seen by ``mine``."""
    now = time.time() if now is None else now
    job = owner.get("job")
    if job and job == mine.get("job"):
        if int(owner.get("restart", 0)) < int(mine.get("restart", 0)):
            return False, "an earlier attempt of this job"
        if owner.get("host") == mine.get("host") and owner.get("pid") == mine.get("pid"):
            return False, "this process"
    if job and job != mine.get("job"):  # another SLURM job: squeue's word is final where it answers
        state = slurm_state(str(job))
        if state is not None:
            return (True, state) if state in ACTIVE else (False, state or "ended")
    if owner.get("host") == mine.get("host"):
        alive = _pid_alive(owner)
        if not alive and not job:
            return False, "ended"
        if alive:
            return True, "running"
    fresh = now - beat < lease_s()
    return fresh, f"heartbeat {now - beat:.0f}s ago" if fresh else "no heartbeat"


def describe_owner(owner: dict, state: str) -> str:
    who = f"job {owner['job']}" if owner.get("job") else f"pid {owner.get('pid')} on {owner.get('host')}"
    return f"{who} ({state})"


def read_owner(run_dir: str | os.PathLike) -> tuple[dict, float] | None:
    """(owner record, heartbeat time) or None when the run dir is free."""
    p = Path(run_dir) / OWNER
    try:
        return json.loads(p.read_text()), p.stat().st_mtime
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}, 0.0  # half-written by a claimant that died: stale


def busy(run_dir: str | os.PathLike, mine: dict | None = None) -> str | None:
    """One line naming the run dir and its live owner, or None when ``mine`` may claim it."""
    found = read_owner(run_dir)
    if found is None:
        return None
    owner, beat = found
    alive, state = owner_alive(owner, mine or me(), beat)
    if not alive:
        return None
    return (f"run.dir {run_dir} is in use by {describe_owner(owner, state)}; wait for it to end, cancel it, "
            "or choose another run.dir")


def claim(run_dir: str | os.PathLike, mine: dict | None = None) -> dict:
    """Make ``mine`` the run dir's owner; raises RunDirBusy (changing nothing) if a live job owns it."""
    run_dir, mine = Path(run_dir), mine or me()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / OWNER
    for _ in range(3):
        why = busy(run_dir, mine)
        if why is not None:
            raise RunDirBusy(why)
        tmp = run_dir / f".owner.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(mine, sort_keys=True) + "\n")
        try:
            if path.exists():  # a dead owner's claim: set it aside (one claimant's rename wins)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, run_dir / f".owner.{uuid.uuid4().hex}.stale")
                for stale in run_dir.glob(".owner.*.stale"):
                    stale.unlink(missing_ok=True)
            os.link(tmp, path)  # fails if another claimant got there first
            return mine
        except FileExistsError:
            continue  # raced: look at the new owner
        finally:
            tmp.unlink(missing_ok=True)
    raise RunDirBusy(f"run.dir {run_dir}: another job claimed it at the same time")


def release(run_dir: str | os.PathLike, mine: dict) -> None:
    """Give the run dir up, if the claim is still ours."""
    found = read_owner(run_dir)
    keys = ("host", "pid", "since")
    if found and all(found[0].get(k) == mine[k] for k in keys):
        (Path(run_dir) / OWNER).unlink(missing_ok=True)


class Heartbeat:
    """Touches the claim every ``lease/4`` seconds from a daemon thread while the stage runs."""

    def __init__(self, run_dir: Path):
        self.path, self.done = Path(run_dir) / OWNER, threading.Event()
        self.thread = threading.Thread(target=self._beat, name="vitp-rundir-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.done.wait(lease_s() / 4):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


class Claim:
    """What ``own_run_dir`` yields: the stage sets ``finished = True`` when the run completed."""

    finished = False


@contextlib.contextmanager
def own_run_dir(run_dir: str | os.PathLike) -> Iterator[Claim]:
    """Every rank: rank 0 claims ``run_dir`` and all ranks learn the verdict (RunDirBusy on every rank,
    before any of them touches the run dir). Needs the process group (a 1-rank one for one process).

    When the stage ends, the claim is given up — except by a SLURM job that stopped or failed before it
    finished: it may be requeued and resume here, so its claim stays, and dies with the job."""
    from pipeline.distributed import all_gather_object, rank_world

    rank, _ = rank_world()
    mine, beat, error = None, None, None
    if rank == 0:
        try:
            mine = claim(run_dir)
            beat = Heartbeat(Path(run_dir))
        except RunDirBusy as e:
            error = str(e)
    error = all_gather_object(error)[0]
    if error is not None:
        raise RunDirBusy(error)
    handle = Claim()
    try:
        yield handle
    finally:
        if rank == 0:
            beat.stop()
            if handle.finished or not mine.get("job"):
                release(run_dir, mine)
