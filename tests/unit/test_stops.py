"""The one vocabulary of stops and attempt outcomes (pipeline/stops.py): the decision after a saved stop
and after a failed attempt, and errors classified by their class."""

from __future__ import annotations

import json

import pytest

from pipeline import errors, stops
from pipeline.stops import Next, Outcome, Stop


def test_words_are_their_strings():
    assert Stop.REQUEUE == "requeue" and f"{Stop.CANCEL}" == "cancel" and str(Outcome.FAILED) == "failed"
    assert json.dumps({"event": Outcome.PREEMPTED}) == '{"event": "preempted"}'


def test_agreement_code_and_reason():
    assert [stops.code(x) for x in (None, Stop.CANCEL, Stop.REQUEUE, "requeue")] == [0.0, 1.0, 2.0, 2.0]
    assert stops.agreed(2.0, Stop.CANCEL) == Stop.REQUEUE  # any rank's USR2 wins
    assert stops.agreed(1.0, None) == Stop.CANCEL and stops.agreed(1.0, Stop.PREEMPT) == Stop.PREEMPT
    assert stops.job_reason("cancel", Stop.REQUEUE) == Stop.CANCEL
    assert stops.job_reason(None, None) == Stop.REQUEUE  # another rank asked: one more try


@pytest.mark.parametrize("reason,term,requeues,want", [
    (Stop.REQUEUE, Stop.CANCEL, 0, (Outcome.REQUEUED, Next.REQUEUE)),
    (Stop.REQUEUE, Stop.PREEMPT, 9, (Outcome.PREEMPTED, Next.REQUEUE)),  # preemptions are not counted
    (Stop.REQUEUE, Stop.CANCEL, 3, (None, Next.FAIL)),  # cluster.max_requeues=3 used up
    (Stop.CANCEL, Stop.PREEMPT, 0, (Outcome.PREEMPTED, Next.REQUEUE)),
    (Stop.CANCEL, Stop.TIME_LIMIT, 0, (Outcome.TIME_LIMIT, Next.END)),
    (Stop.CANCEL, Stop.CANCEL, 0, (Outcome.CANCELLED, Next.END)),
])
def test_after_stop(reason, term, requeues, want):
    assert stops.after_stop(reason, term, requeues, max_requeues=3) == want


def test_after_failure():
    assert stops.after_failure(True, 0, 2) == (Next.REQUEUE, None)
    assert stops.after_failure(True, 2, 2) == (Next.FAIL, "cluster.max_failures=2 used up")
    assert stops.after_failure(False, 0, 2) == (Next.FAIL, "a retry would fail the same way")


def test_errors_classified_by_class_not_name():
    class Mine(errors.Classified, RuntimeError):
        exit_code, retry = 1, False

    class Sub(Mine):
        exit_code = 2

    class RunDirBusy(RuntimeError):  # a name alone says nothing
        pass

    assert (errors.exit_code(Mine()), errors.retried(Mine())) == (1, False)
    assert (errors.exit_code(Sub()), errors.retried(Sub())) == (2, False)  # the most specific class that says
    assert errors.exit_code(RunDirBusy()) is None and errors.retried(RunDirBusy())
    assert not errors.retried(ModuleNotFoundError("x")) and errors.retried(OSError("stale file handle"))
