"""How each attempt of a SLURM job ended, and what happens after a task dies.

A job may run several times under one job id (SLURM requeues it): every attempt ends with one line
in the job folder's ``events.jsonl``, which survives requeues because the folder does::

    {"event": "requeued",  "restart": 0, "step": 7, ...}   time limit near (USR2): saved, requeued itself
    {"event": "preempted", "restart": 1, "step": 16, ...}  a higher-priority job took the nodes (TERM
                                                           with a PreemptTime): saved, requeued itself
    {"event": "failed",    "restart": 2, "rank": 1, "error": "killed by SIGKILL", "requeued": true, ...}
                                                           (or "hung: ..., stuck in FRAME": pipeline/hang.py)
    {"event": "failed", ..., "node": "node2", "fault": "NCCL error", "excluded": ["node2"], ...}
                                                           a failure that points at its node: requeued
                                                           without it (launch/nodes.py)
    {"event": "cancelled", "restart": 3, "step": 20, ...}  scancel / vitp cancel: saved, stops for good
    {"event": "time_limit", ...}                           TERM at the time limit itself: saved, ends
    {"event": "completed", "restart": 3, "step": 24, ...}

The ranks write the first two and the last two themselves (launch/job_body.py). A rank that is
SIGKILLed (the OOM killer, a segfault, a lost node) cannot write anything, so "failed" is written by
the batch script after ``srun`` returns (:func:`end_of_attempt`, the sbatch teardown): srun runs with
``--kill-on-bad-exit=1``, so the first task that dies ends the step at once, whichever rank it was,
rank 0 included; the batch script survives it, finds which task died first and why (srun's own
``task N: Killed`` line, that rank's error record), and requeues the job while fewer than
``cluster.max_failures`` attempts have failed. Errors a retry cannot fix (a bad config, a missing
dataset, a busy run dir, a non-finite loss) are not retried. The next attempt resumes from the last
complete checkpoint like any requeue.

Time-limit requeues are bounded by ``cluster.max_requeues``, failures by ``cluster.max_failures``;
preemptions are the site's decision and are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import time
from pathlib import Path

from pipeline import error_record, slurm, stops
from pipeline.config.sections import ClusterCfg
from pipeline.files import append_jsonl, read_jsonl
from pipeline.stops import Next, Outcome

from . import nodes

EVENTS = "events.jsonl"
ATTEMPT_MARK = "vitp: attempt {restart} of job {job} starts"  # echoed by the batch script (setup)
NODES_MARK = "vitp: attempt nodes {nodes}"  # echoed next: the allocation, for a lost batch host's attempt
_NODES_LINE = re.compile(r"^vitp: attempt nodes (\S+)\s*$", re.M)
MOVED_RC = 3  # start_of_attempt: requeued without a left-out node; the batch script ends without srun
MAX_EXCLUDED = ClusterCfg.model_fields["max_excluded_nodes"].default  # the teardown's line names any other


def append_event(folder: str | os.PathLike, event: dict) -> None:
    """One line per attempt end; an append of one short line does not interleave with another."""
    append_jsonl(Path(folder) / EVENTS, [{"time": time.time(), **event}], sort_keys=True)


def read_events(folder: str | os.PathLike) -> list[dict]:
    return read_jsonl(Path(folder) / EVENTS)


def count(events: list[dict], kind: str) -> int:
    return sum(e.get("event") == kind for e in events)


@dataclasses.dataclass(frozen=True)
class Elastic:
    """A job that may run on fewer nodes than planned (cluster.min_nodes < cluster.nodes).

    SLURM's own range (``--nodes=min-max``) is not used: with a fixed task count per node select/cons_tres
    starts such a job on ``min`` nodes however many are idle (measured, SLURM 22.05). Instead each requeue
    vitp makes asks for the nodes the partition has up now (:func:`launch.nodes.nodes_up`: not down,
    drained or failed, busy or not), less those the job leaves out, kept between ``min_nodes`` and
    ``nodes``; each attempt runs on what it got (the batch script sets the task count from it) and
    records the count in its line of events.jsonl."""

    min_nodes: int
    nodes: int
    tasks_per_node: int = 1

    @classmethod
    def of(cls, cluster) -> Elastic | None:
        """The cluster section's elastic range; None for a job of a fixed node count."""
        if cluster.fewest_nodes >= cluster.nodes:
            return None
        return cls(cluster.fewest_nodes, cluster.nodes, cluster.tasks_per_node)

    @classmethod
    def parse(cls, text: str | None) -> Elastic | None:
        """``MIN:MAX:TASKS_PER_NODE`` (the batch script's command line) -> Elastic; None for None."""
        return cls(*map(int, text.split(":"))) if text else None

    def __str__(self) -> str:
        return f"{self.min_nodes}:{self.nodes}:{self.tasks_per_node}"

    def fields(self, environ: dict | None = None) -> dict:
        """This attempt's node count for its events.jsonl line: {"nodes": got, "of_nodes": planned}."""
        env = os.environ if environ is None else environ
        got = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        return {"nodes": int(got), "of_nodes": self.nodes} if got else {}

    def size(self, left_out: list[str], partition: str | None, up=nodes.nodes_up) -> int:
        """How many nodes the next attempt asks for: the partition's nodes up now, less ``left_out``, kept
        within [min_nodes, nodes] (all of them when sinfo cannot say)."""
        have = up(partition)
        if have is None:
            return self.nodes
        return max(self.min_nodes, min(self.nodes, len([n for n in have if n not in left_out])))

    def requeue(self, job_id: str, left_out: list[str], partition: str | None, exclude_changed: bool = False,
                up=nodes.nodes_up) -> None:
        """Requeue the job asking for :meth:`size` nodes (and, when ``exclude_changed``, without ``left_out``)."""
        slurm.requeue_as(job_id, exclude=left_out if exclude_changed else None,
                         nodes=self.size(left_out, partition, up), tasks_per_node=self.tasks_per_node)


def describe(event: dict) -> str:
    """One attempt's end for `vitp jobs`, e.g. "attempt 1: failed: rank 1 killed by SIGKILL; requeued"."""
    kind, step = event.get("event", "?"), event.get("step")
    at = f" at step {step}" if step is not None else ""
    what = {Outcome.REQUEUED: f"time limit near{at}: saved, requeued",
            Outcome.PREEMPTED: f"preempted{at}: saved, requeued",
            Outcome.CANCELLED: f"cancelled{at}" + (" (checkpoint saved)" if step is not None else ""),
            Outcome.TIME_LIMIT: f"time limit reached{at} (checkpoint saved; cluster.max_requeues used up?)",
            Outcome.COMPLETED: f"completed{at}",
            Outcome.LOST: "ended and requeued by SLURM itself (no node failure seen)",
            Outcome.MOVED: f"started on {event.get('node', '?')}, which the job leaves out: requeued without it"
            }.get(kind)
    if kind == Outcome.FAILED and event.get("fault"):  # a failure that points at its node
        node = event.get("node", "?")
        what = f"failed: rank {event.get('rank', '?')} on {node}: {event['fault']}"
        what += f"; {', '.join(event['excluded'])} excluded" if event.get("excluded") else ""
        what += f"; {node} not excluded ({event['kept']})" if event.get("kept") else ""
        what += "; requeued" if event.get("requeued") else f"; not requeued ({event.get('why', 'no retry')})"
    elif kind == Outcome.FAILED and event.get("oom"):  # the micro batch it ran with, and the next one's
        (had, then), rank = event.get("micro_batch") or ("?", None), event.get("rank", "?")
        what = f"out of memory on rank {rank} at train.micro_batch {had}"
        what += (f"; requeued with train.micro_batch {then} (train.global_batch kept)" if event.get("requeued")
                 else f"; not requeued ({event.get('why', 'no retry')})")
    elif kind == Outcome.FAILED:
        what = f"failed: rank {event.get('rank', '?')}: {event.get('error', '?')}"
        what += "; requeued" if event.get("requeued") else f"; not requeued ({event.get('why', 'no retry')})"
    on = f" on {event['nodes']} of {event['of_nodes']} nodes" if event.get("of_nodes") else ""
    return f"attempt {event.get('restart', '?')}{on}: {what or kind}"


# --------------------------------------------------------------------------------------------------
# The batch script's end of an attempt
# --------------------------------------------------------------------------------------------------
_SIGNALS = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}


def first_dead_task(log_text: str) -> tuple[int, str] | None:
    """srun's report of the first task that ended badly: (rank, "killed by SIGKILL" | "exit code 1"), from
    lines like ``srun: error: node2: task 1: Killed`` or ``...: tasks 0-3: Exited with exit code 1``."""
    for task in nodes.srun_tasks(log_text):
        rank, what = task.ranks[0], task.what
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        if code:
            return rank, f"exit code {code[1]}"
        name = _SIGNALS.get(what.removesuffix(" (core dumped)"))
        return rank, f"killed by {name}" if name else what
    return None


def this_attempt(log_text: str, restart: int, job: str) -> str:
    """The part of the batch log written by this attempt (the log is appended to across requeues)."""
    mark = ATTEMPT_MARK.format(restart=restart, job=job)
    i = log_text.rfind(mark)
    return log_text[i:] if i >= 0 else log_text


def _tail(path: Path, limit: int = 4 << 20) -> str:
    """The last ``limit`` bytes of a log (srun reports a dead task at the end of the attempt)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _oom(rec: dict) -> dict:
    """An error record's out-of-memory fields (pipeline/error_record.py write_error): the micro batch it ran at."""
    return {"oom": True, "micro_batch": rec.get("micro_batch")} if rec.get("oom") else {}


def failure(folder: Path, restart: int, log_text: str, rc: int) -> dict:
    """What ended this attempt: {"rank", "error", "retry"}: a rank that hung outside any collective
    (pipeline/hang.py; the ranks waiting for it hang too), else srun's first dead task and that rank's
    error record (or, without srun's line, the earliest error record of this attempt)."""
    recs = error_record.read(folder, restart)
    stuck = [r for r in recs if r.get("hang") and not r.get("waiting")]
    if stuck:
        return {"rank": stuck[0].get("rank", "?"), "error": stuck[0].get("error"), "retry": True}
    dead = first_dead_task(log_text)
    if dead is not None:
        rank, how = dead
        rec = next((r for r in recs if r.get("rank") == rank), None)
        if rec is not None:
            return {"rank": rank, "error": rec.get("error", how), "retry": rec.get("retry", True), **_oom(rec)}
        return {"rank": rank, "error": how, "retry": True}
    if recs:
        first = recs[0]
        return {"rank": first.get("rank", "?"), "error": first.get("error"), "retry": first.get("retry", True),
                **_oom(first)}
    return {"rank": "?", "error": f"srun exited with code {rc}", "retry": True}


def job_folder_name(environ: dict | None = None) -> str:
    """The submitit folder of this job: ``JOBID``, or ``ARRAYID_TASK`` for an array task."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


_RANK_START = re.compile(r"^vitp: \S+ rank \d+/\d+ .* restart (\d+)$", re.M)  # launch/job_body.py's first line


def _rank_log(folder: Path, name: str, rank, restart: int) -> str:
    """Rank ``rank``'s own log (stderr) of this attempt: after its start line of this restart."""
    if not isinstance(rank, int):
        return ""
    text = _tail(folder / f"{name}_{rank}_log.err", 1 << 20)
    starts = [m for m in _RANK_START.finditer(text) if int(m[1]) == restart]
    return text[starts[-1].start():] if starts else ""


def _exclusion(fault: nodes.Fault, then: Next, why_not: str | None, events: list[dict], env: dict,
               exclude: list[str], max_excluded: int, pool, elastic: Elastic | None = None
               ) -> tuple[dict, Next, str | None]:
    """A failure that points at ``fault.node``: the event's fields, what next and why not requeued (a
    job whose failures are used up still records the node, for `vitp submit` to carry over)."""
    fields = {"node": fault.node, "fault": fault.reason}
    already = nodes.excluded(exclude, events)
    needed = elastic.min_nodes if elastic else int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    partition = env.get("SLURM_JOB_PARTITION")
    add, kept, fails = nodes.leave_out(fault.node, already, max_excluded, needed,
                                       pool(partition) if callable(pool) else pool, partition)
    if fails:  # a job that fails anyway keeps its own reason
        return fields, Next.FAIL, why_not if then != Next.REQUEUE else fails
    fields.update({"excluded": add} if add else {"kept": kept})
    return fields, then, why_not


def _failed(restart: int, why: dict, fault: nodes.Fault | None, events: list[dict], env: dict, max_failures: int,
            exclude: list[str], max_excluded: int, pool, elastic: Elastic | None = None, **extra) -> dict:
    """The "failed" line of attempt ``restart``: requeued while failures < max_failures, with the node the
    failure points at left out (``exclude``: the nodes the job was submitted without)."""
    if why.get("oom") and isinstance(why.get("micro_batch"), int):  # halved, not counted as a failure
        then, half, why_not = stops.after_oom(why["micro_batch"])
        event = {"event": Outcome.FAILED, "restart": restart, "rank": why["rank"], "oom": True,
                 "error": why["error"] + ("" if half else f" at train.micro_batch {why['micro_batch']}, which "
                                          "cannot be halved"), **extra, "micro_batch": [why["micro_batch"], half],
                 "requeued": then == Next.REQUEUE}
        return {**event, "why": why_not} if why_not else event
    failed = sum(e.get("event") == Outcome.FAILED and not e.get("oom") for e in events)
    then, why_not = stops.after_failure(why["retry"], failed, max_failures)
    fields: dict = {}
    if fault is not None and why["retry"]:
        fields, then, why_not = _exclusion(fault, then, why_not, events, env, exclude, max_excluded, pool, elastic)
    event = {"event": Outcome.FAILED, "restart": restart, "rank": why["rank"], "error": why["error"], **extra,
             **fields, "requeued": then == Next.REQUEUE}
    if why_not:
        event["why"] = why_not
    return event


def _record(folder: Path, event: dict) -> None:
    append_event(folder, event)
    print(f"vitp: {describe(event)}", file=sys.stderr, flush=True)


def end_of_attempt(log_dir: Path, rc: int, max_failures: int, environ: dict | None = None, requeue=None,
                   exclude: list[str] | None = None, max_excluded: int = MAX_EXCLUDED,
                   pool=nodes.partition_nodes, elastic: Elastic | None = None) -> int:
    """The batch script after ``srun`` returned ``rc``: record a failed attempt and requeue the job
    while failures < max_failures, without the node the failure points at (``exclude``: the nodes the job
    was submitted without; ``pool``: the partition's nodes, or how to ask for them). Returns the batch
    script's exit code (non-zero: the job FAILED)."""
    env = os.environ if environ is None else environ
    name, job_id = job_folder_name(env), env["SLURM_JOB_ID"]
    restart = slurm.restart_count(env)
    folder = Path(log_dir) / name
    events = read_events(folder)
    if any(e.get("restart") == restart for e in events):
        return 0  # the ranks said how this attempt ended (and requeued it, where it comes back)
    if rc == 0:
        return 0
    log = folder / f"{name}_0_log.err"  # submitit's sbatch --error: srun's own messages land here
    text = this_attempt(_tail(log), restart, job_id)
    why = failure(folder, restart, text, rc)
    fault = nodes.find_fault(text, why, _rank_log(folder, name, why["rank"], restart))
    on = elastic.fields(env) if elastic else {}
    event = _failed(restart, why, fault, events, env, max_failures, exclude or [], max_excluded, pool, elastic,
                    rc=rc, **on)
    _record(folder, event)
    if not event["requeued"]:
        return rc
    if elastic is not None and requeue is None:  # the next attempt asks for the nodes it can get
        elastic.requeue(job_id, nodes.excluded(exclude, [*events, event]), env.get("SLURM_JOB_PARTITION"),
                        exclude_changed=bool(event.get("excluded")))
    elif event.get("excluded"):  # every node left out so far: the update replaces the list
        (requeue or slurm.requeue_excluding)(job_id, nodes.excluded(exclude, [*events, event]))
    else:
        (requeue or slurm.requeue)(job_id)
    return 0


def previous_attempt(log_text: str, restart: int, job: str) -> str:
    """The part of the batch log that attempt ``restart - 1`` wrote ("" when its mark is not there)."""
    start = log_text.rfind(ATTEMPT_MARK.format(restart=restart - 1, job=job))
    end = log_text.rfind(ATTEMPT_MARK.format(restart=restart, job=job))
    return "" if start < 0 else log_text[start:end if end > start else None]


def start_of_attempt(log_dir: Path, max_failures: int, environ: dict | None = None, requeue=None,
                     exclude: list[str] | None = None, max_excluded: int = MAX_EXCLUDED, pool=nodes.partition_nodes,
                     hostnames=nodes.hostnames, down=nodes.down_nodes, elastic: Elastic | None = None) -> int:
    """The batch script before ``srun``, on a requeued attempt.

    An attempt that left no line in events.jsonl was ended by SLURM itself, which then requeued the job:
    NODE_FAIL kills the batch script with the ranks, so no teardown ran. It is recorded here: "failed"
    at the node srun said it lost (or, when the batch host itself was lost with its log, a node of that
    attempt slurmctld now holds down), which the job then leaves out like any node a failure points at;
    else "lost". SLURM refuses ExcNodeList for a running job, so an attempt given a node the job leaves
    out requeues itself without it (once: "moved"). -> 0: run srun; MOVED_RC: requeued, run nothing;
    else the job fails with it (cluster.max_failures used up, or too few nodes left)."""
    env = os.environ if environ is None else environ
    restart = slurm.restart_count(env)
    if restart == 0:
        return 0
    name, job_id = job_folder_name(env), env["SLURM_JOB_ID"]
    folder = Path(log_dir) / name
    events = read_events(folder)
    if not any(e.get("restart") == restart - 1 for e in events):
        text = previous_attempt(_tail(folder / f"{name}_0_log.err"), restart, job_id)
        allocation = _NODES_LINE.search(text)
        had = hostnames(allocation[1]) if allocation else []
        node = nodes.lost_node(text) or next(iter(down(had)), None)
        if node is None:
            event = {"event": Outcome.LOST, "restart": restart - 1}
        else:
            rank = nodes.task_on(text, node)  # srun may be gone before it says; else block distribution's first
            if rank == "?" and node in had:
                rank = had.index(node) * int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
            why = {"rank": rank, "error": f"node failure: {node} (NODE_FAIL)", "retry": True}
            event = _failed(restart - 1, why, nodes.Fault(node, "node failure"), events, env, max_failures,
                            exclude or [], max_excluded, pool, elastic)
        if elastic is not None and had:  # the lost attempt's allocation
            event.update(nodes=len(had), of_nodes=elastic.nodes)
        _record(folder, event)
        events.append(event)
        if event["event"] == Outcome.FAILED and not event["requeued"]:
            return 1
    left_out = nodes.excluded(exclude, events)
    given = [n for n in hostnames(env.get("SLURM_JOB_NODELIST", "")) if n in left_out] if left_out else []
    if not given or any(e.get("event") == Outcome.MOVED and e.get("restart") == restart - 1 for e in events):
        return 0  # (moved once already: SLURM did not take the update; run where it put the job)
    _record(folder, {"event": Outcome.MOVED, "restart": restart, "node": given[0]})
    if elastic is not None and requeue is None:
        elastic.requeue(job_id, left_out, env.get("SLURM_JOB_PARTITION"), exclude_changed=True)
    else:
        (requeue or slurm.requeue_excluding)(job_id, left_out)
    return MOVED_RC


def batch_lines(log_dir: str, max_failures: int, python: str | None = None, exclude: list[str] | None = None,
                max_excluded: int = MAX_EXCLUDED, elastic: Elastic | None = None) -> tuple[list[str], list[str]]:
    """(setup, teardown) lines of the sbatch script: mark where this attempt's log starts; after srun,
    hand its exit code to :func:`end_of_attempt` (teardown's first line runs right after srun, so $? is
    srun's status) and end the batch script with what that decides."""
    import shlex

    py = shlex.quote(python or sys.executable)
    cmd = (f"{py} -m launch.attempts --log-dir {shlex.quote(str(Path(log_dir).resolve()))} "
           f"--max-failures {int(max_failures)}"
           + (f" --max-excluded {int(max_excluded)}" if max_excluded != MAX_EXCLUDED else "")
           + "".join(f" --exclude {shlex.quote(n)}" for n in exclude or [])
           + (f" --elastic {elastic}" if elastic else ""))
    setup = ['echo "' + ATTEMPT_MARK.format(restart="${SLURM_RESTART_COUNT:-0}", job="$SLURM_JOB_ID") + '" >&2',
             'echo "' + NODES_MARK.format(nodes="$SLURM_JOB_NODELIST") + '" >&2',
             f'if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then {cmd} --start; vitp_rc=$?; '
             f'[ $vitp_rc = 0 ] || exit $(( vitp_rc == {MOVED_RC} ? 0 : vitp_rc )); fi']
    if elastic:  # srun's task count from the nodes this attempt got (sbatch exported the submitted one)
        setup.append(f"export SLURM_NTASKS=$(( SLURM_JOB_NUM_NODES * {elastic.tasks_per_node} )); "
                     "export SLURM_NPROCS=$SLURM_NTASKS")
    teardown = ["vitp_rc=$?", f"{cmd} --rc $vitp_rc", "exit $?"]
    return setup, teardown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.attempts",
                                description="End of a SLURM attempt (the sbatch teardown vitp writes): record a "
                                            "failed attempt and requeue it while failures < --max-failures. "
                                            "Example: python -m launch.attempts --log-dir runs/jobs "
                                            "--max-failures 2 --rc 137")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--max-failures", type=int, required=True)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--rc", type=int, help="srun's exit status (the teardown, after srun)")
    how.add_argument("--start", action="store_true", help="a requeued attempt's start (the setup, before srun)")
    p.add_argument("--max-excluded", type=int, default=MAX_EXCLUDED, help="cluster.max_excluded_nodes")
    p.add_argument("--exclude", action="append", default=[], help="a node the job was submitted without")
    p.add_argument("--elastic", metavar="MIN:MAX:TASKS_PER_NODE",
                   help="cluster.min_nodes:cluster.nodes:cluster.tasks_per_node of a job that may run on fewer nodes")
    args = p.parse_args(argv)
    elastic = Elastic.parse(args.elastic)
    if args.start:
        return start_of_attempt(Path(args.log_dir), args.max_failures, exclude=args.exclude,
                                max_excluded=args.max_excluded, elastic=elastic)
    return end_of_attempt(Path(args.log_dir), args.rc, args.max_failures, exclude=args.exclude,
                          max_excluded=args.max_excluded, elastic=elastic)


if __name__ == "__main__":
    sys.exit(main())
