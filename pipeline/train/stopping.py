"""A process-wide "please stop at the next step boundary" flag.

Whoever learns that the job must end early (a SLURM warning signal, preemption, `scancel`) calls
:func:`request_stop`; training loops poll :func:`stop_reason` once per step, agree across ranks
(any rank asking is enough), save a checkpoint on every rank and return. Setting a flag is all a
signal handler may safely do.
"""

from __future__ import annotations

_reason: str | None = None


def request_stop(reason: str) -> None:
    """Ask the running stage to checkpoint and stop; ``reason`` e.g. "requeue" or "cancel"."""
    global _reason
    if _reason is None:
        _reason = reason


def stop_reason() -> str | None:
    return _reason


def clear() -> None:
    global _reason
    _reason = None
