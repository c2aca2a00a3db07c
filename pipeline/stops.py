"""Why a job stops and how an attempt ends: one vocabulary, one decision.

Standard library only, on the ground floor: the training loop, the test-fault seam, data_prep and
launch/ all read it, so a new fault behaviour adds a word here and a branch in one decision below.

    Stop       why a run stopped early (the stop request, ``Result.reason``, the job's stop_reason)
    Status     how a stage's call ended (``Result.status``, result.json's "status")
    Outcome    how one attempt of a SLURM job ended (the "event" of its line in events.jsonl)
    Next       what the attempt does next: requeue, fail, or end for good

Whether another attempt could get past an error is its class's to say (pipeline/errors.py).
"""

from __future__ import annotations

import enum


class _Word(str, enum.Enum):
    """A word that is also its string: compares, formats and serialises as its value."""

    __str__ = str.__str__
    __format__ = str.__format__


class Stop(_Word):
    CANCEL = "cancel"  # scancel, vitp cancel, SIGTERM under a plain launcher: saved, ends for good
    REQUEUE = "requeue"  # USR2: the time limit is near; saved, requeued (bounded by cluster.max_requeues)
    PREEMPT = "preempt"  # TERM while RUNNING with a PreemptTime (PreemptMode=REQUEUE): saved, requeued
    TIME_LIMIT = "time_limit"  # TERM at the time limit itself: saved, ends
    LOST = "lost"  # TERM after SLURM requeued the job itself (a node of it failed): saved where it can


class Status(_Word):
    COMPLETED = "completed"  # the stage ran to its end
    STOPPED = "stopped"  # asked to stop (a Stop): every rank saved; the job's stop_reason says why


class Outcome(_Word):
    REQUEUED = "requeued"
    PREEMPTED = "preempted"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    COMPLETED = "completed"
    LOST = "lost"  # ended and requeued by SLURM itself, no node failure seen (an admin's scontrol requeue)
    MOVED = "moved"  # started on a node the job leaves out: requeued without it before running anything


class Next(_Word):
    REQUEUE = "requeue"
    FAIL = "fail"
    END = "end"


# --------------------------------------------------------------------------------------------------
# The process-wide stop request: a signal handler sets it (all it may safely do), the loop polls it
# --------------------------------------------------------------------------------------------------
_reason: Stop | None = None


def request_stop(reason: Stop | str) -> None:
    """Ask the running stage to checkpoint and stop at the next step boundary (the first ask wins)."""
    global _reason
    if _reason is None:
        _reason = Stop(reason)


def stop_reason() -> Stop | None:
    return _reason


def clear() -> None:
    global _reason
    _reason = None


# --------------------------------------------------------------------------------------------------
# The one decision: why a run stopped, and what its attempt does next
# --------------------------------------------------------------------------------------------------
def code(asked: Stop | str | None) -> float:
    """A rank's stop request as the number the ranks all-reduce (max): 2 a requeue, which wins over
    1 any other reason (on a time limit SLURM sends USR2 first and TERM at the end), 0 none."""
    return 0.0 if asked is None else 2.0 if asked == Stop.REQUEUE else 1.0


def agreed(stop_code: float, own: Stop | None) -> Stop:
    """The run's reason for an agreed stop code: a requeue if any rank asked one, else this rank's own
    request, else (another rank asked) a cancel."""
    return Stop.REQUEUE if stop_code == 2 else (own or Stop.CANCEL)


def job_reason(stage_reason: str | None, own: Stop | None) -> Stop:
    """The stop reason of a job's task: the stage's agreed one, else this rank's own signal; a stop that
    another rank asked without a known reason is a requeue (losing a run is worse than one more try)."""
    if stage_reason in (Stop.REQUEUE, Stop.CANCEL):
        return Stop(stage_reason)
    return own or Stop.REQUEUE


_ON_STOP = {Stop.REQUEUE: (Outcome.REQUEUED, Next.REQUEUE), Stop.PREEMPT: (Outcome.PREEMPTED, Next.REQUEUE),
            Stop.TIME_LIMIT: (Outcome.TIME_LIMIT, Next.END), Stop.CANCEL: (Outcome.CANCELLED, Next.END),
            Stop.LOST: (None, Next.REQUEUE)}  # requeued already: the next attempt says why (launch/attempts.py)


def after_stop(reason: Stop, term: Stop, requeues: int, max_requeues: int) -> tuple[Outcome | None, Next]:
    """A saved stop on SLURM: ``reason`` the job's (:func:`job_reason`), ``term`` what SLURM says the TERM
    was (a site may preempt with USR2 too), ``requeues`` time-limit requeues so far. -> (the attempt's
    outcome, what next); (None, FAIL) when a time-limit requeue is due but cluster.max_requeues is used up;
    (None, REQUEUE) when SLURM requeued the job itself: nothing to record or ask."""
    cause = (Stop.PREEMPT if term == Stop.PREEMPT else Stop.REQUEUE) if reason == Stop.REQUEUE else term
    if cause == Stop.REQUEUE and requeues >= max_requeues:
        return None, Next.FAIL
    return _ON_STOP[cause]


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an accelerator running out of memory: torch.OutOfMemoryError (torch.cuda's is the
    same class), known by its class name so this module stays torch-free."""
    return any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__)


def after_oom(micro_batch: int) -> tuple[Next, int | None, str | None]:
    """An attempt a rank's out-of-memory error ended, at ``micro_batch`` (train.micro_batch as it ran):
    requeue with half of it (train.global_batch kept, so the accumulation doubles and the run continues
    exactly); fail when it cannot be halved. -> (what next, the next micro batch, why not requeued).
    Bounded without cluster.max_failures: each one halves."""
    if micro_batch < 2 or micro_batch % 2:
        return Next.FAIL, None, f"train.micro_batch {micro_batch} cannot be halved"
    return Next.REQUEUE, micro_batch // 2, None


def micro_batch_now(events: list[dict], planned: int) -> int:
    """The train.micro_batch an attempt runs with: the last out-of-memory requeue's (events.jsonl, see
    :func:`after_oom`), else the config's ``planned`` one."""
    halved = [e["micro_batch"][1] for e in events if e.get("oom") and e.get("requeued")]
    return halved[-1] if halved else planned


def after_failure(retry: bool, failed_before: int, max_failures: int) -> tuple[Next, str | None]:
    """An attempt that failed (a rank died, raised or hung): requeue while a retry could help and fewer
    than ``max_failures`` attempts failed before. -> (what next, why not requeued)."""
    if not retry:
        return Next.FAIL, "a retry would fail the same way"
    if failed_before >= max_failures:
        return Next.FAIL, f"cluster.max_failures={max_failures} used up"
    return Next.REQUEUE, None
