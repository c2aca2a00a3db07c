"""A bad node left out: which failures point at the node a rank ran on, and the nodes a job leaves out.

An attempt that failed (launch/attempts.py, the batch script after srun) is blamed on a node when

- the dead rank's error record names a CUDA or NCCL error (not CUDA's out-of-memory, which is the run's),
- an Xid line of the NVIDIA driver (``NVRM: Xid (PCI:...): 79, ...``) is in the dead rank's log of this
  attempt (where a site's tooling echoes the kernel's), except the Xids NVIDIA documents as the
  application's (13, 31, 43, 45), or
- srun reports the node lost (``srun: error: Node failure on node2``; SLURM's NODE_FAIL).

Such a node is recorded in the attempt's line of events.jsonl (``"excluded": ["node2"]``, the
``"fault"``) and the job is requeued without it (:func:`pipeline.slurm.requeue_excluding`). A job leaves
out at most ``cluster.max_excluded_nodes`` nodes, counting those it was submitted without; a node
that would leave the partition fewer nodes than the job needs fails the job with one line instead of
leaving it pending for good. A SIGKILL (the OOM killer), a config error or a non-finite loss blames
no node. `vitp submit` carries the run dir's left-out nodes to its next job (:func:`carry_over`);
``cluster.exclude_nodes`` sets them (``[]``: none).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# the error record's text (pipeline's error_line: "Class: message") -> the fault it names
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.I)
_ERRORS = (("NCCL error", re.compile(r"\bNCCL (?:error|communicator was aborted)|\bnccl(?:System|Internal|"
                                     r"UnhandledCuda|Remote)Error\b")),
           ("CUDA error", re.compile(r"\bCUDA error\b|\bcudaError\w+|\bCUBLAS_STATUS_EXECUTION_FAILED\b|"
                                     r"uncorrectable ECC error")))
_XID = re.compile(r"NVRM: Xid \([^)]*\): (\d+)")
APP_XIDS = frozenset({13, 31, 43, 45})  # NVIDIA: an application's fault (or its cleanup), not the GPU's
_NODE_FAIL = re.compile(r"^srun: error: Node failure on (?P<node>\S+)\s*$", re.M)
_SRUN_TASK = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+?)\s*$", re.M)


class Fault(NamedTuple):
    node: str
    reason: str  # "CUDA error", "NCCL error", "Xid 79", "node failure"


def error_fault(error: str | None) -> str | None:
    """The fault an error record's text names, if it points at the node."""
    if not error or _OOM.search(error):
        return None
    return next((name for name, pattern in _ERRORS if pattern.search(error)), None)


def xid_fault(text: str) -> str | None:
    """The first Xid line of the driver that is not the application's: "Xid 79"."""
    for m in _XID.finditer(text):
        if int(m[1]) not in APP_XIDS:
            return f"Xid {m[1]}"
    return None


class SrunTask(NamedTuple):
    node: str
    ranks: list[int]  # ascending
    what: str  # "Killed", "Exited with exit code 1", ...


def srun_tasks(log_text: str) -> Iterator[SrunTask]:
    """srun's reports of tasks that ended badly, in order (``srun: error: node2: tasks 1-3: Killed``)."""
    for m in _SRUN_TASK.finditer(log_text):
        ranks: set[int] = set()
        for part in m["tasks"].split(","):
            a, _, b = part.partition("-")
            ranks.update(range(int(a), int(b or a) + 1))
        yield SrunTask(m["node"], sorted(ranks), m["what"])


def node_of(log_text: str, rank) -> str | None:
    """The node srun says task ``rank`` ended on (``srun: error: node2: task 1: Killed``)."""
    if not isinstance(rank, int):
        return None
    return next((t.node for t in srun_tasks(log_text) if rank in t.ranks), None)


def lost_node(log_text: str) -> str | None:
    """The node srun says it lost (``srun: error: Node failure on node2``)."""
    m = _NODE_FAIL.search(log_text)
    return m["node"].split(",")[0] if m else None


def task_on(log_text: str, node: str):
    """The first task srun reports ended on ``node`` (``srun: error: node2: task 1: Terminated``), or "?"."""
    return next((t.ranks[0] for t in srun_tasks(log_text) if t.node == node), "?")


def find_fault(log_text: str, why: dict, rank_log: str = "") -> Fault | None:
    """The node this attempt's failure points at: a lost node (srun's line), else the dead rank's node when
    its error record or an Xid line names a GPU fault. ``log_text``: this attempt's batch log (srun's
    lines); ``why``: launch/attempts.py's failure() ({"rank", "error", ...}); ``rank_log``: the dead
    rank's own log of this attempt."""
    lost = lost_node(log_text)
    if lost:
        return Fault(lost, "node failure")
    if str(why.get("error") or "").startswith("hung:"):
        return None  # a stuck rank's own doing, as far as anyone can tell
    reason = error_fault(why.get("error")) or xid_fault(rank_log)  # the batch log is no rank's in particular
    node = node_of(log_text, why.get("rank"))
    return Fault(node, reason) if node and reason else None


def excluded(submitted: list[str] | None, events: list[dict]) -> list[str]:
    """The nodes a job leaves out now: those it was submitted without, then each attempt's, in order."""
    out = list(submitted or [])
    for e in events:
        out += [n for n in e.get("excluded", []) if n not in out]
    return out


def leave_out(node: str, already: list[str], cap: int, needed: int, pool: list[str] | None,
              partition: str | None) -> tuple[list[str], str | None, str | None]:
    """Whether to leave ``node`` out too. -> (nodes to exclude now, why not (the job still goes on), why
    the job fails: ``pool``, the partition's nodes, would keep fewer than ``needed`` without it)."""
    if node in already:
        return [], f"{node} already excluded", None
    if len(already) >= cap:
        return [], f"cluster.max_excluded_nodes={cap} reached", None
    if pool is not None:
        left = [n for n in pool if n not in already and n != node]
        if len(left) < needed:
            return [], None, (f"cluster.exclude_nodes: without {node} partition {partition or '(default)'} keeps "
                              f"{len(left)} of its {len(pool)} nodes ({', '.join(left) or 'none'}), fewer than the "
                              f"job's {needed}")
    return [node], None, None


def hostnames(nodelist: str, run=subprocess.run) -> list[str]:
    """A SLURM node list (``node[1,3]``) as names (``scontrol show hostnames``; [] when it cannot say)."""
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    try:
        r = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return r.stdout.split() if r.returncode == 0 else []


def down_nodes(names: list[str], run=subprocess.run) -> list[str]:
    """Those of ``names`` that slurmctld holds down, failed or not responding now (sinfo's compact state:
    ``down``, ``fail``, a ``*`` suffix)."""
    if not names:
        return []
    try:
        r = run(["sinfo", "-h", "-N", "-o", "%N %t", "-n", ",".join(names)], capture_output=True, text=True,
                timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    out: list[str] = []
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        name, _, state = line.strip().partition(" ")
        if (state.startswith(("down", "fail")) or state.endswith("*")) and name not in out:
            out.append(name)
    return out


def partition_nodes(partition: str | None, run=subprocess.run) -> list[str] | None:
    """The nodes of ``partition`` (None: the default one), from sinfo; None when sinfo cannot say."""
    try:
        r = run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode:
        return None
    nodes: list[str] = []
    for line in r.stdout.splitlines():
        name, _, part = line.strip().partition(" ")
        if name and name not in nodes and (part.rstrip("*") == partition if partition else part.endswith("*")):
            nodes.append(name)
    return nodes or None


_GONE = ("down", "drain", "drng", "fail", "futr", "inval", "maint")  # sinfo's compact states of a node out of use


def nodes_up(partition: str | None, run=subprocess.run) -> list[str] | None:
    """The nodes of ``partition`` (None: the default one) in use or usable: not down, drained or draining,
    failed, in maintenance or not responding (``*``), whether idle or busy now; None when sinfo cannot say."""
    try:
        r = run(["sinfo", "-h", "-N", "-o", "%N %t %P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode:
        return None
    up: list[str] = []
    for line in r.stdout.splitlines():
        name, state, part = (line.split() + ["", "", ""])[:3]
        mine = part.rstrip("*") == partition if partition else part.endswith("*")
        if name and mine and name not in up and not state.startswith(_GONE) and not state.endswith("*"):
            up.append(name)
    return up


# --------------------------------------------------------------------------------------------------
# `vitp submit`: the run dir's left-out nodes carried to its next job
# --------------------------------------------------------------------------------------------------
def carried(index: list[dict], run_dir: str, events_of) -> tuple[list[str], str | None]:
    """What the latest training job of ``run_dir`` in a log dir's ``index`` left out (its submitted nodes
    and its attempts': ``events_of(folder)``), and that job's id."""
    run = Path(run_dir).resolve()
    same = [e for e in index if e.get("stage") in ("pretrain", "transfer") and e.get("run_dir")
            and Path(e["run_dir"]).resolve() == run]
    if not same:
        return [], None
    last = same[-1]
    return excluded(last.get("exclude_nodes"), events_of(last.get("folder", ""))), last["job_id"]


def carry_over(cfg, stage: str, index: list[dict], events_of) -> str | None:
    """Set cfg.cluster.exclude_nodes where the config left it unset: a training stage takes what the run
    dir's latest job in ``index`` (cluster.log_dir's) left out, anything else none. -> a line saying what
    was carried, if anything."""
    c = cfg.cluster
    if c.exclude_nodes is not None:
        return None
    nodes, job = carried(index, cfg.run.dir, events_of) if stage in ("pretrain", "transfer") else ([], None)
    c.exclude_nodes = nodes
    if not nodes:
        return None
    return (f"run.dir {cfg.run.dir}: leaving out {', '.join(nodes)} as job {job} did "
            "(cluster.exclude_nodes=[] to use every node)")


def nodes_left_problem(cfg, pool: list[str] | None) -> str | None:
    """One line when the nodes left out leave the partition fewer nodes than the job needs."""
    c = cfg.cluster
    if pool is None or not c.exclude_nodes:
        return None
    left = [n for n in pool if n not in c.exclude_nodes]
    if len(left) >= c.fewest_nodes:
        return None
    fewest = f"cluster.min_nodes={c.min_nodes}" if c.fewest_nodes < c.nodes else f"cluster.nodes={c.nodes}"
    return (f"cluster.exclude_nodes: without {', '.join(c.exclude_nodes)} partition {c.partition or '(default)'} "
            f"keeps {len(left)} of its {len(pool)} nodes, fewer than {fewest}")
