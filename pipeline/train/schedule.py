"""Learning-rate schedules as pure functions of the step, so a schedule's whole state is the step.

Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine / linear / constant decay to
``end_lr`` at ``total_steps`` (the paper: 10k warm-up, linear decay).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int = 0, decay: str = "cosine",
          end_lr: float = 0.0) -> float:
    """Learning rate for optimizer step ``step`` (0-based: the first update uses ``lr_at(0)``)."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / span)
    if decay == "linear":
        return end_lr + (lr - end_lr) * (1.0 - frac)
    if decay == "cosine":
        return end_lr + (lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"schedule.decay: unknown decay {decay!r}")


class Schedule:
    """The run's learning rate by optimizer step: ``schedule(step)`` -> lr (its whole state is the step).
    Its settings span three sections (the builder reads them: ``optim.lr``, ``train.steps`` and the
    ``schedule`` section), so it takes them as the values :func:`lr_at` names."""

    def __init__(self, *, lr: float, total_steps: int, warmup_steps: int, decay: str, end_lr: float):
        self.lr, self.total_steps = lr, total_steps
        self.warmup_steps, self.decay, self.end_lr = warmup_steps, decay, end_lr

    def __call__(self, step: int) -> float:
        return lr_at(step, lr=self.lr, total_steps=self.total_steps, warmup_steps=self.warmup_steps,
                     decay=self.decay, end_lr=self.end_lr)
