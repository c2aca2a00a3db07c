"""The declared evaluators (pipeline/eval/evaluators) inside a training run: two periodic tasks of the
loop, one on each side of the step's checkpoint, as each evaluator's type declares.

    Evaluations "evals_before"   types with ``after_checkpoint = False`` (classify): cheap and
                                 stateless; their metrics go to the record the checkpoint covers
    Evaluations "evals"          the rest (few-shot, the linear probe): run once the step is saved,
                                 so a kill inside them resumes right there; which steps each did is a
                                 checkpointed state, completed from metrics.jsonl (a step evaluated
                                 after the resumed checkpoint was written is not evaluated again)

An evaluator is due at the run's last step and every ``every`` steps (0: only at the last; after
the checkpoint, only a step it has not done). A task runs its due evaluators in declared order, on
the weights the run exports (the EMA's, swapped in and back, when optim.ema is on), and returns
their metrics plus ``<prefix>seconds`` (wall time, summed over the evaluators of one prefix) and,
the first time, ``<prefix>setup_seconds`` (building them: the few-shot label scan). It prints the
metrics it returned. A stop request that arrives meanwhile is honoured at the step boundary after.
"""

from __future__ import annotations

import contextlib
import time

import torch

from pipeline.distributed import all_reduce, rank0_print
from pipeline.eval.evaluators import Evaluator
from pipeline.train.ema import Ema

QUIET = ("seconds", "_std", "images_per_s")  # keys a log line leaves out (they stay in the record)


def key_prefix(ev: Evaluator) -> str:
    """The prefix every metric key of ``ev`` starts with."""
    return getattr(ev, "key_prefix", ev.prefix)


class Evaluations:
    """Evaluators of one side of the checkpoint as one periodic task (and, after it, one checkpointed
    state: each evaluator's newest evaluated step, equal on every rank). ``every``: by evaluator
    name; ``setup_s``: the seconds each took to build."""

    checkpoint_scope = "shared"

    def __init__(self, evaluators: list[Evaluator], *, engine, device, every: dict[str, int], last_step: int,
                 after_checkpoint: bool, ema: Ema | None = None, setup_s: dict[str, float] | None = None):
        self.evaluators, self.engine, self.device, self.ema = evaluators, engine, device, ema
        self.every, self.last_step, self.after_checkpoint = every, last_step, after_checkpoint
        self.name = "evals" if after_checkpoint else "evals_before"
        self.done = {ev.name: 0 for ev in evaluators}
        self.setup_s = dict(setup_s or {})

    def __bool__(self) -> bool:
        return bool(self.evaluators)

    def state_dict(self) -> dict:
        return {"done": dict(self.done)}

    def load_state_dict(self, sd: dict) -> None:
        for name, step in sd["done"].items():
            if name in self.done:
                self.done[name] = max(self.done[name], int(step))

    def skip_logged(self, history: list[dict]) -> None:
        """Collective. A step evaluated after the resumed checkpoint was written (a kill came later)
        is in metrics.jsonl (rank 0 read it) but not in the checkpoint: count it done, on every rank."""
        if not self.evaluators:
            return
        logged = [max((r["step"] for r in history if any(k.startswith(key_prefix(ev)) and not k.endswith("seconds")
                                                          for k in r)), default=0) for ev in self.evaluators]
        logged = all_reduce(torch.tensor(logged, dtype=torch.int64, device=self.device), "max").tolist()
        for ev, step in zip(self.evaluators, logged):
            self.done[ev.name] = max(self.done[ev.name], int(step))

    def _due(self, ev: Evaluator, step: int) -> bool:
        every = self.every.get(ev.name, 0)
        on_time = step == self.last_step or (every > 0 and step % every == 0)
        return on_time and (step > self.done[ev.name] or not self.after_checkpoint)

    def due(self, step: int) -> bool:
        return any(self._due(ev, step) for ev in self.evaluators)

    def run(self, step: int) -> dict:
        """Collective: the due evaluators -> their metrics (rank 0's; {} or less elsewhere)."""
        out: dict = {}
        module = getattr(self.engine, "module", self.engine)
        # the weights the run exports: the average when optim.ema is on (put back after)
        with self.ema.applied(module) if self.ema is not None else contextlib.nullcontext():
            for ev in self.evaluators:
                if not self._due(ev, step):
                    continue
                t0 = time.perf_counter()
                got = ev.run(self.engine, step)
                self.done[ev.name] = step
                if not got:
                    continue
                out.update(got)
                spent = f"{ev.prefix}seconds"
                out[spent] = out.get(spent, 0.0) + time.perf_counter() - t0
                if ev.name in self.setup_s:
                    setup = f"{ev.prefix}setup_seconds"
                    out[setup] = out.get(setup, 0.0) + self.setup_s.pop(ev.name)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in out.items() if not k.endswith(QUIET))
        if shown:
            rank0_print(f"step {step:>7d}  {shown}")
        return out
