"""The submission index and the operator commands: `vitp jobs`, `vitp logs`, `vitp cancel`.

Every submission appends one line to ``<cluster.log_dir>/index.jsonl`` (job id, stage, folder,
executor, run dir, sweep id). A job's state comes from SLURM (squeue keeps finished jobs for
MinJobAge; sacct when accounting exists); submitit's own watcher needs sacct, which small clusters
often lack. The job's result.json (written by rank 0, see launch/job_body.py) says how it ended, or
its error records (pipeline/error_record.py) say which error ended it; a job that left neither and
that no scheduler lists any more was killed. events.jsonl has one line per attempt (launch/attempts.py):
`vitp jobs` lists them under a job that ran more than once or did not simply complete.
Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline import error_record
from pipeline.files import append_jsonl, read_jsonl
from pipeline.stops import Outcome, Status, Stop

from .attempts import describe, read_events
from .cli import print_error

DEFAULT_LOG_DIR = "runs/jobs"
INDEX = "index.jsonl"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


def append_index(log_dir: str | os.PathLike, entry: dict) -> None:
    d = Path(log_dir)
    d.mkdir(parents=True, exist_ok=True)
    append_jsonl(d / INDEX, [entry], sort_keys=True)


def read_index(log_dir: str | os.PathLike) -> list[dict]:
    return read_jsonl(Path(log_dir) / INDEX)


class UnknownJob(ValueError):
    """A job id that this log dir does not know (exit 2)."""


def find_job(job_id: str, log_dir: str | os.PathLike) -> dict:
    for e in reversed(read_index(log_dir)):
        if e["job_id"] == job_id:
            return e
    folder = Path(log_dir) / job_id
    if folder.is_dir():
        return {"job_id": job_id, "folder": str(folder), "executor": "slurm"}
    raise UnknownJob(f"job {job_id}: not in {Path(log_dir) / INDEX} (use --log-dir)")


# --------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


GONE = "GONE"  # squeue answered without the job and sacct does not know it: the job has ended


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM state per job id ("123" or array task "123_4"). A job squeue no longer lists (MinJobAge
    passed) and sacct does not know (no accounting) is GONE; while squeue cannot be reached the ids
    are left out (their state is unknown, not ended)."""
    want = set(job_ids)
    if not want:
        return {}
    states: dict[str, str] = {}
    out = _run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T"])
    for line in (out or "").splitlines():
        jid, _, state = line.strip().partition("|")
        if jid in want:
            states[jid] = state.upper()
    missing = sorted(want - set(states))
    if missing:
        acct = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", *[f"-j{j}" for j in missing]]) or ""
        for line in acct.splitlines():
            jid, _, state = line.strip().partition("|")
            if jid in want and state:
                states[jid] = state.split()[0].upper()  # "CANCELLED by 0" → CANCELLED
    if out is not None:
        states.update({j: GONE for j in want - set(states)})
    return states


def read_result(folder: str | os.PathLike) -> dict | None:
    p = Path(folder) / "result.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _local_alive(pid: str) -> bool:
    """The local executor's controller (a `submitit.local._local` process) still runs. A zombie (the
    submitting process has not reaped it) or a pid recycled by another program is not it, where /proc
    can tell."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, OSError):
        return False
    proc = Path(f"/proc/{int(pid)}")
    try:
        if proc.joinpath("stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False
        cmdline = proc.joinpath("cmdline").read_bytes()  # empty for an instant while it execs
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all there is
    return not cmdline or b"submitit" in cmdline


def ended_state(folder: str | os.PathLike) -> str:
    """The state of a job that no longer runs, from what it left: result.json, else error records."""
    res = read_result(folder)
    if res is None:
        return "FAILED"  # an error record, or nothing at all: killed, out of memory, node lost
    if res.get("status") == Status.COMPLETED:
        return "COMPLETED"
    return "CANCELLED" if res.get("stop_reason") == Stop.CANCEL else "FAILED"


def job_state(entry: dict, slurm: dict[str, str] | None = None) -> str:
    """SLURM's state (or, once SLURM has forgotten the job, what the job left behind); for local jobs
    (pid ids) RUNNING while the controller lives, then what it left. UNKNOWN: SLURM cannot be asked."""
    jid, folder = entry["job_id"], entry.get("folder", "")
    executor = entry.get("executor", "slurm")
    if executor == "slurm":
        state = (slurm if slurm is not None else slurm_states([jid])).get(jid)
        if state is None:
            return ended_state(folder) if read_result(folder) else "UNKNOWN"
        return ended_state(folder) if state == GONE else state
    if executor == "local" and _local_alive(jid) and read_result(folder) is None:
        return "RUNNING"
    return ended_state(folder)


def wait(entries: list[dict], poll_s: float = 2.0, timeout_s: float | None = None) -> dict[str, str]:
    """Block until every job is in a terminal state (bounded polling of squeue/sacct, result files)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        slurm = slurm_states([e["job_id"] for e in entries if e.get("executor", "slurm") == "slurm"])
        states = {e["job_id"]: job_state(e, slurm) for e in entries}
        if all(s in TERMINAL for s in states.values()):
            return states
        if deadline is not None and time.monotonic() > deadline:
            return states
        time.sleep(poll_s)


def outcome(entry: dict, state: str) -> tuple[bool, str]:
    """(ok, one line) for a finished job: ok only when SLURM says COMPLETED and the stage completed;
    otherwise the line carries the error's last line (or says that the job left none)."""
    jid, folder = entry["job_id"], entry["folder"]
    res = read_result(folder) or {}
    status = res.get("status")
    ok = state == "COMPLETED" and status == Status.COMPLETED
    detail = f"status={status}" + (f" step={res['step']}" if "step" in res else "")
    if res.get("stop_reason"):
        detail += f" stop_reason={res['stop_reason']}"
    if ok or status == Status.STOPPED:
        return bool(ok), f"job {jid} {state} {detail} (logs: vitp logs {jid})"
    failed = [e for e in read_events(folder) if e.get("event") == Outcome.FAILED]
    if failed:  # the batch script's record: which rank died first and why (launch/attempts.py)
        last, rank = failed[-1], failed[-1].get("rank", 0)
        note = f"; {last['why']}" if str(last.get("why", "")).startswith("cluster.") else ""  # limit used up
        why = f"{last.get('error')} (rank {rank}{note}; logs: vitp logs {jid} --rank {rank})"
        return False, f"job {jid} {state}: {why}"
    errors = error_record.read(folder)
    if errors:
        rank = errors[0].get("rank", 0)
        return False, f"job {jid} {state}: {errors[0].get('error')} (rank {rank}; logs: vitp logs {jid} --rank {rank})"
    why = detail if res else "no result.json and no error record: the job was killed (time limit, memory, node?)"
    return False, f"job {jid} {state}: {why} (logs: vitp logs {jid})"


def tracking_line(run_dir: str) -> str:
    """'tracking: delivered', or how many records wait in the run dir's spool and the `vitp sync`
    command that delivers them (pipeline/tracking/mlflow_sink.py; the spool is gone once synced)."""
    from pipeline.tracking.mlflow_sink import MlflowSink

    return MlflowSink.outcome(run_dir)


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------
def jobs_main(argv: list[str]) -> int:
    from .cli import parser_for

    p = parser_for("jobs", "List submitted jobs (newest last) with their state.")
    p.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="cluster.log_dir of the submissions")
    p.add_argument("-n", "--last", type=int, default=20, help="show the last N submissions")
    args = p.parse_args(argv)
    if args.last < 1:
        raise ValueError(f"--last: must be >= 1; got {args.last}")
    entries = read_index(args.log_dir)[-args.last:]
    if not entries:
        print(f"no jobs in {Path(args.log_dir) / INDEX}")
        return 0
    slurm = slurm_states([e["job_id"] for e in entries if e.get("executor", "slurm") == "slurm"])
    print(f"{'JOB':<12} {'STAGE':<9} {'STATE':<11} {'SUBMITTED':<19} {'TASKS':>5}  RUN_DIR  (TRACKING)")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
        state = job_state(e, slurm)
        done = state in TERMINAL and e.get("stage") != "prep" and e.get("run_dir")
        print(f"{e['job_id']:<12} {e.get('stage', '?'):<9} {state:<11} {when:<19} "
              f"{e.get('tasks', 1):>5}  {e.get('run_dir', '')}"
              + (f"  ({tracking_line(e['run_dir'])})" if done else ""))
        events = read_events(e.get("folder", ""))
        if len(events) > 1 or any(ev.get("event") != Outcome.COMPLETED for ev in events):
            for ev in events:  # how each attempt ended, when there was more than one plain completion
                print(f"  {describe(ev)}")
    return 0


def _log_path(entry: dict, rank: int, stream: str) -> Path:
    return Path(entry["folder"]) / f"{entry['job_id']}_{rank}_log.{stream}"


def logs_main(argv: list[str]) -> int:
    from .cli import parser_for

    p = parser_for("logs", "Print a job's log (stdout, then stderr) for one rank.")
    p.add_argument("job", help="job id as printed by `vitp submit` (array task: 123_4)")
    p.add_argument("--rank", type=int, default=0, help="global rank (task) whose log to show")
    p.add_argument("--stream", choices=["out", "err", "both"], default="both")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--log-dir", default=DEFAULT_LOG_DIR)
    args = p.parse_args(argv)
    entry = find_job(args.job, args.log_dir)
    streams = ["out", "err"] if args.stream == "both" else [args.stream]
    paths = [_log_path(entry, args.rank, s) for s in streams]
    if not args.follow:
        found = False
        for path in paths:
            if path.is_file():
                found = True
                print(f"==> {path} <==") if len(paths) > 1 else None
                sys.stdout.write(path.read_text(errors="replace"))
        if not found:
            print_error(f"no log yet for job {args.job} rank {args.rank} ({paths[0]})")
            return 1
        return 0
    offsets = {p: 0 for p in paths}
    while True:
        done = job_state(entry) in TERMINAL
        for path in paths:
            if path.is_file():
                with open(path, errors="replace") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
                    offsets[path] = f.tell()
                sys.stdout.write(chunk)
                sys.stdout.flush()
        if done:
            return 0
        time.sleep(1.0)


def cancel_main(argv: list[str]) -> int:
    from .cli import parser_for

    p = parser_for("cancel", "Cancel a job: every rank gets SIGTERM, saves a checkpoint if it can "
                             "and exits without requeue.")
    p.add_argument("job", nargs="+", help="job id(s)")
    p.add_argument("--log-dir", default=DEFAULT_LOG_DIR)
    args = p.parse_args(argv)
    rc = 0
    for jid in args.job:
        entry = find_job(jid, args.log_dir)
        if entry.get("executor") == "local":
            try:
                os.kill(int(jid), 15)
            except (ValueError, OSError) as e:
                print_error(f"cancel {jid}: {e}")
                rc = 1
            continue
        try:  # read at SIGTERM time: this TERM is a cancel, whatever else SLURM says (launch/job_body.py)
            (Path(entry["folder"]) / "cancel-requested").write_text(f"{time.time()}\n")
        except OSError:
            pass  # the job folder is gone or not writable; SLURM's state tells a cancel apart too
        r = subprocess.run(["scancel", jid], capture_output=True, text=True)
        if r.returncode:
            print_error(f"scancel {jid}: {r.stderr.strip()}")
            rc = 1
        else:
            print(f"cancelled {jid}")
    return rc
