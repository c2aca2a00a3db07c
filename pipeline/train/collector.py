"""Python's garbage collector under the loop's control.

A generation-2 collection walks every tracked object of the process: in a run, hundreds of thousands
(torch, DeepSpeed, the model's modules and parameters, the loader's state), tens to hundreds of
milliseconds. Left to itself it comes whenever enough objects survived younger collections, at a
different step on each rank; the others then wait for that rank at the step's next collective, and
with 256 ranks some rank is always collecting. So:

- once the run is built, what exists then is moved out of the collector's sight (``gc.freeze()``):
  it lives as long as the run, and no collection need walk it again;
- generation 2 is never collected by the interpreter during training (its threshold out of reach);
  the loop collects it at log steps (:meth:`Collector.at`), the same step on every rank, a step that
  waits for the device anyway. Generations 0 and 1 (young objects, cheap) run as usual.
"""

from __future__ import annotations

import gc

NEVER = 2**30  # a generation-2 threshold no run reaches: gen-1 collections between two gen-2 ones


class Collector:
    """``with Collector(): ...`` around the steps; ``at(step, due)`` after each step."""

    def __enter__(self) -> Collector:
        gc.collect()
        gc.freeze()
        self.thresholds = gc.get_threshold()
        gc.set_threshold(self.thresholds[0], self.thresholds[1], NEVER)
        return self

    def at(self, due: bool) -> None:
        """Collect every generation if this step is a log step (``due``)."""
        if due:
            gc.collect(2)

    def __exit__(self, *exc) -> None:
        gc.set_threshold(*self.thresholds)
        gc.unfreeze()
