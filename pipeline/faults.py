"""Test-only fault injection behind one seam: production code calls ``faults.hit(event, at)`` where a
test may need a fault, and nothing else about faults lives in production modules.

With no fault variable set, ``hit`` costs a dict lookup or two (``os.environ``); it never imports
torch, so data_prep (torch-free) calls it too. Events and their variables (values ``[SCOPE:]K``):

    event          at            variable                        what happens when it matches
    "step"         step k        VITP_TEST_KILL_AT_STEP=k        SIGKILL before step k runs
    "save_begin"   step k        VITP_TEST_KILL_BEFORE_WRITE=k   SIGKILL when checkpoint k's write begins (in
                                                                 the background: training goes on meanwhile)
    "save"         step k        VITP_TEST_KILL_DURING_SAVE=k    SIGKILL after checkpoint k's files are
                                                                 written, before it is published
    "publish"      step k        VITP_TEST_KILL_AT_PUBLISH=k     SIGKILL (of rank 0, which publishes) after
                                                                 checkpoint k's manifest, before its rename
    "fewshot"      step k        VITP_TEST_KILL_DURING_FEWSHOT=k SIGKILL inside step k's few-shot evaluator
    "prep_sample"  sample index  VITP_PREP_TEST_KILL_AT=SHARD:K  SIGKILL the prep process handling sample
                   (scope: shard)                                K of SHARD

The training events kill only rank VITP_TEST_KILL_RANK (default 1; the ``RANK`` the launcher set).

Slow loader, :func:`slow_batch`: VITP_TEST_SLOW_BATCH_S=s holds every fetch of a training batch s seconds
on every rank (a loader that cannot keep up).

Hang, event "step": VITP_TEST_HANG_AT_STEP=k blocks rank VITP_TEST_KILL_RANK before step k, for good and
outside any collective (pipeline/hang.py's watch then dumps its stacks and ends it); on a job's first
attempt only, so the requeued one runs through.

GPU fault, event "step": VITP_TEST_CUDA_ERROR_AT_STEP=k makes the rank on node VITP_TEST_FAULT_NODE (the
SLURMD_NODENAME slurmd gives a task; unset: rank VITP_TEST_KILL_RANK) raise a CUDA error before step k,
so the error record it leaves is a real GPU fault's (launch/nodes.py then leaves the node out); on a
job's first attempt only.

Out of memory, event "step": VITP_TEST_OOM_AT_STEP=k makes rank VITP_TEST_KILL_RANK raise
torch.OutOfMemoryError (the class a CUDA OOM raises, also on CPU) before step k, on a job's first attempt
only, so the requeued attempt (half the micro batch, launch/attempts.py) runs through.

Inf gradient, :func:`poison_grad`: VITP_TEST_INF_GRAD_AT_STEP=k makes step k's loss back-propagate an inf
gradient on rank VITP_TEST_KILL_RANK (its value stays finite), as an overflow in one rank's backward would.

Records, not faults: VITP_TEST_READ_LOG=P appends the keys of each training micro-batch a rank's loader
hands out to ``P.<rank>`` (:func:`record_read`: which samples were read, by which SLURM attempt, counted by a test);
VITP_TEST_OPTIM_DUMP=D writes the full optimizer state (rank 0, ``D/saved-<step>.pt`` at each save,
``D/resumed-<step>.pt`` after a resume; :func:`optimizer_dump`) so a test compares them across world sizes.

Pause gate, event "step": VITP_TEST_PAUSE_AT_STEP=k[,k2...] (0: before the stage starts, see
launch/job_body.py) with VITP_TEST_PAUSE_FILE=P holds every rank before step k. Each rank writes
``P.k.reached.<rank>``, then waits until ``P.k`` exists (at most VITP_TEST_PAUSE_TIMEOUT_S, default
600, then TimeoutError); a stop request it receives meanwhile (a signal the test sent) is written to
``P.k.stop.<rank>``. So a test makes a signal land at the step it chooses: wait for every
``reached``, signal, wait for the ``stop`` files, create ``P.k``.

Write gate, event "save_begin": VITP_TEST_HOLD_WRITE=k with VITP_TEST_PAUSE_FILE=P holds every rank's
background write of checkpoint k at the same kind of gate, named ``P.write.k`` (training goes on
meanwhile): a signal can land while a write is in flight.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from pipeline import slurm, stops
from pipeline.files import atomic_write

KILL_AT_STEP = "VITP_TEST_KILL_AT_STEP"
KILL_DURING_SAVE = "VITP_TEST_KILL_DURING_SAVE"
KILL_BEFORE_WRITE = "VITP_TEST_KILL_BEFORE_WRITE"
KILL_AT_PUBLISH = "VITP_TEST_KILL_AT_PUBLISH"
KILL_DURING_FEWSHOT = "VITP_TEST_KILL_DURING_FEWSHOT"
KILL_RANK = "VITP_TEST_KILL_RANK"
PREP_KILL_AT = "VITP_PREP_TEST_KILL_AT"
INF_GRAD_AT_STEP = "VITP_TEST_INF_GRAD_AT_STEP"
SLOW_BATCH_S = "VITP_TEST_SLOW_BATCH_S"
HANG_AT_STEP = "VITP_TEST_HANG_AT_STEP"
CUDA_ERROR_AT_STEP = "VITP_TEST_CUDA_ERROR_AT_STEP"
OOM_AT_STEP = "VITP_TEST_OOM_AT_STEP"
FAULT_NODE = "VITP_TEST_FAULT_NODE"
PAUSE_AT_STEP = "VITP_TEST_PAUSE_AT_STEP"
PAUSE_FILE = "VITP_TEST_PAUSE_FILE"
PAUSE_TIMEOUT_S = "VITP_TEST_PAUSE_TIMEOUT_S"
HOLD_WRITE = "VITP_TEST_HOLD_WRITE"
READ_LOG = "VITP_TEST_READ_LOG"
OPTIM_DUMP = "VITP_TEST_OPTIM_DUMP"

_KILL = {"step": KILL_AT_STEP, "save": KILL_DURING_SAVE, "save_begin": KILL_BEFORE_WRITE, "publish": KILL_AT_PUBLISH,
         "fewshot": KILL_DURING_FEWSHOT, "prep_sample": PREP_KILL_AT}
_RANKED = frozenset({"step", "save", "save_begin", "publish", "fewshot"})  # training events: only the chosen rank dies


def hit(event: str, at: int, scope: str = "") -> None:
    """The seam: a fault set for ``event`` at ``at`` (within ``scope``, e.g. a shard name) happens here."""
    if event == "step" and PAUSE_AT_STEP in os.environ:
        _pause(at)
    if event == "save_begin" and HOLD_WRITE in os.environ and int(os.environ[HOLD_WRITE]) == at:
        _gate(f"{os.environ[PAUSE_FILE]}.write.{at}")
    if event == "step" and HANG_AT_STEP in os.environ and int(os.environ[HANG_AT_STEP]) == at and _chosen_rank() \
            and slurm.restart_count() == 0:
        _hang()
    if event == "step" and CUDA_ERROR_AT_STEP in os.environ and int(os.environ[CUDA_ERROR_AT_STEP]) == at \
            and _chosen_node() and slurm.restart_count() == 0:
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered (test fault)")
    if event == "step" and OOM_AT_STEP in os.environ and int(os.environ[OOM_AT_STEP]) == at and _chosen_rank() \
            and slurm.restart_count() == 0:
        import torch  # only with the variable set: data_prep calls hit() without torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test fault)")
    want = os.environ.get(_KILL[event])
    if want is None:
        return
    where, _, k = want.rpartition(":")
    if where != scope or int(k) != at:
        return
    if event in _RANKED and not _chosen_rank():
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _chosen_rank() -> bool:
    return int(os.environ.get("RANK", 0)) == int(os.environ.get(KILL_RANK, 1))


def _chosen_node() -> bool:
    node = os.environ.get(FAULT_NODE)
    return _chosen_rank() if node is None else os.environ.get("SLURMD_NODENAME") == node


def _hang() -> None:
    while True:  # the fault itself: no progress, no collective, the GIL free (as a stuck I/O call)
        time.sleep(1)


def slow_batch() -> None:
    """The seam where the training loop fetches a batch: held VITP_TEST_SLOW_BATCH_S seconds."""
    delay = os.environ.get(SLOW_BATCH_S)
    if delay:
        time.sleep(float(delay))  # the fault itself (a slow loader), not a wait for anything


def poison_grad(step: int, loss) -> None:
    """The seam in a training step: ``loss`` (a scalar tensor) of step ``step`` gets an inf gradient here
    when VITP_TEST_INF_GRAD_AT_STEP asks for it on this rank."""
    want = os.environ.get(INF_GRAD_AT_STEP)
    if want is None or int(want) != step or int(os.environ.get("RANK", 0)) != int(os.environ.get(KILL_RANK, 1)):
        return
    loss.register_hook(lambda grad: grad * float("inf"))


def _pause(step: int) -> None:
    if step not in {int(k) for k in os.environ[PAUSE_AT_STEP].split(",") if k.strip()}:
        return
    _gate(f"{os.environ[PAUSE_FILE]}.{step}")


def _gate(base: str) -> None:
    rank = os.environ.get("RANK", "0")
    release = Path(base)
    Path(f"{base}.reached.{rank}").touch()
    deadline = time.monotonic() + float(os.environ.get(PAUSE_TIMEOUT_S, "600"))
    noted = False
    while not release.exists():  # waiting for the test, which holds the release file
        if not noted and stops.stop_reason() is not None:
            atomic_write(Path(f"{base}.stop.{rank}"), stops.stop_reason())
            noted = True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{PAUSE_FILE}: {release} not created within the timeout")
        time.sleep(0.02)
    if not noted and stops.stop_reason() is not None:
        atomic_write(Path(f"{base}.stop.{rank}"), stops.stop_reason())


def record_read(rank: int, epoch: int, step: int, keys) -> None:
    """The seam where a training loader hands out micro-batch ``step`` of ``epoch``: its sample keys
    are appended to VITP_TEST_READ_LOG's ``.<rank>`` file when that is set."""
    log = os.environ.get(READ_LOG)
    if log:
        with open(f"{log}.{rank}", "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "keys": list(keys),
                                "restart": slurm.restart_count()}) + "\n")


def optimizer_dump(what: str, step: int) -> Path | None:
    """Where to write the full optimizer state at ``what`` ("saved" or "resumed") of ``step``, when
    VITP_TEST_OPTIM_DUMP asks for it; else None."""
    d = os.environ.get(OPTIM_DUMP)
    return Path(d) / f"{what}-{step}.pt" if d else None
