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


def lr_for(cfg, step: int) -> float:
    """``lr_at`` with the config's optim/schedule/train sections."""
    s = cfg.schedule
    return lr_at(step, lr=cfg.optim.lr, total_steps=cfg.train.steps, warmup_steps=s.warmup_steps,
                 decay=s.decay, end_lr=s.end_lr)
