"""The error record: ``<job folder>/error.<rank>.json``, one per rank, saying why that rank died.

    write(folder, rank, error_line, retry=..., **fields)   the only writer (the job body's exception
                                                           handler via write_error, the hang watchdog)
    write_error(folder, rank, exception, micro_batch)      an exception's record
    read(folder, restart=None)                             the only reader, earliest first

The first rank to fail names the cause; the others usually failed because it left their collective.
A record carries ``rank``, ``restart`` (SLURM_RESTART_COUNT of the attempt that wrote it), ``time``,
``error`` (one line, "Class: message"), ``retry`` (whether another attempt could help) and what its
writer adds: ``oom``/``micro_batch`` for an out-of-memory error (launch/attempts.py halves it),
``hang``/``frame``/``waiting`` for a hang (pipeline/hang.py). `vitp jobs`, `vitp submit --wait` and the
batch script's end of an attempt read it, so a failed job says why even where no scheduler remembers it.
Standard library only at import time, on the ground floor.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pipeline import errors, slurm, stops
from pipeline.files import write_json

NAME = "error.{rank}.json"


def error_line(e: BaseException) -> str:
    """The error's last line, e.g. "DataError: x/_info.json: not found" (a multi-line message: its last)."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[-1].strip()}" if len(lines) == 1 else f"{type(e).__name__}: ... {lines[-1]}"


def write(folder: str | os.PathLike, rank: int, error: str, *, retry: bool, **fields) -> None:
    """Record why ``rank`` died (``error``: one line). Never raises OSError: the record is a courtesy,
    and whatever ended the rank must still propagate (or exit)."""
    path = Path(folder) / NAME.format(rank=rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"rank": rank, "restart": slurm.restart_count(), "time": time.time(), "error": error,
                          "retry": retry, **fields})
    except OSError as oe:
        print(f"vitp: could not write {path} ({oe})", file=sys.stderr, flush=True)


def write_error(folder: str | os.PathLike, rank: int, e: BaseException, micro_batch: int | None = None) -> None:
    """The record of the exception ``e`` that ended this rank's stage; an out-of-memory error also records
    the ``micro_batch`` it ran at."""
    from pipeline.secrets import redact  # an error text may quote a URI with its credentials

    oom = {"oom": True, "micro_batch": micro_batch} if stops.out_of_memory(e) and micro_batch else {}
    write(folder, rank, redact(error_line(e)), retry=errors.retried(e), **oom)


def read(folder: str | os.PathLike, restart: int | None = None) -> list[dict]:
    """The ranks' records in ``folder``, earliest first (ties: the lower rank); ``restart``: only those
    that attempt wrote. An unreadable or half-written record is skipped."""
    out = []
    for p in Path(folder).glob(NAME.format(rank="*")):
        if not p.name.split(".")[1].isdigit():
            continue
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if restart is None or rec.get("restart", 0) == restart:
            out.append(rec)
    return sorted(out, key=lambda r: (r.get("time", 0), r.get("rank", 0)))
