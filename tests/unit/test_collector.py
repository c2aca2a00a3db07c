"""Python's collector under the loop's control (pipeline/train/collector.py): generation 2 only at log
steps, what existed before training frozen out of its sight, the interpreter's settings put back."""

from __future__ import annotations

import gc

import pytest

from pipeline.train.collector import Collector


@pytest.fixture
def collections_by_step():
    """Each step's collections, by generation (gc.callbacks); the interpreter's thresholds low enough
    that long-lived growth collects generation 2 within a few steps when nothing stops it."""
    saved, seen = gc.get_threshold(), {}
    current = {"step": 0}

    def record(phase, info):
        if phase == "start":
            seen.setdefault(current["step"], []).append(info["generation"])
    gc.collect()
    gc.freeze()  # the test process's own objects: a full collection weighs what the steps add against
    gc.collect()  # what survives now (CPython's long-lived heuristic), not against all of pytest
    gc.callbacks.append(record)
    gc.set_threshold(100, 2, 2)
    try:
        yield current, seen
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*saved)
        gc.unfreeze()


def _steps(current, collector, kept, n=12, every=4):
    for step in range(1, n + 1):
        current["step"] = step
        kept.extend([{"step": step}] for _ in range(3000))  # objects that live on, as a run's do
        if collector is not None:
            collector.at(step % every == 0)
    current["step"] = 0


def test_generation_2_only_at_log_steps(collections_by_step):
    current, seen = collections_by_step
    kept: list = []
    _steps(current, None, kept)  # left to itself, generation 2 comes at steps the loop does not choose
    assert any(2 in seen.get(s, []) for s in range(1, 13) if s % 4)
    seen.clear()
    with Collector() as collector:
        assert gc.get_threshold()[:2] == (100, 2) and gc.get_threshold()[2] >= 2**30
        assert gc.get_freeze_count() > len(kept)  # what exists at the start is out of sight
        _steps(current, collector, kept)
    assert [s for s in range(1, 13) if 2 in seen.get(s, [])] == [4, 8, 12]
    assert all(seen[s].count(2) == 1 for s in (4, 8, 12))
    assert any(1 in seen.get(s, []) for s in range(1, 13))  # the young generations collect as usual
    assert gc.get_threshold() == (100, 2, 2) and gc.get_freeze_count() == 0
