"""A rank that makes no progress leaves its stacks, then ends its attempt like a dead rank.

Progress is a training step done (:func:`beat`). Start-up (build, load, compile, the first batches)
and the work that may rightly take long between steps (periodic tasks, a checkpoint, a rank-0-only
wait) keep the rank alive (:func:`busy`), so a slow collective there meets the collective timeout,
never this watch. After ``seconds`` without progress a watcher thread

1. writes ``hang.<rank>.txt`` into the job folder: one line naming the frame the main thread stands
   in, then every thread's Python stack (``faulthandler``) and, where NCCL's flight recorder is on,
   its dump beside it (``nccl_trace_rank_<rank>``, as on a collective timeout);
2. writes its error record (pipeline/error_record.py; launch/attempts.py retries it, like a dead rank) and
3. ends the process (exit code :data:`EXIT_CODE`): srun's --kill-on-bad-exit ends the step, the batch
   script requeues the attempt.

A rank waiting inside a collective (a frame of torch.distributed, deepspeed.comm or
pipeline/distributed.py on its main thread's stack) waits :data:`GRACE` longer: when one rank is stuck
and the others wait for it, the stuck one dumps first and is the rank the attempt's record names. If
the main thread holds the GIL for good (a C call that never releases it) the watcher cannot run;
``faulthandler.dump_traceback_later``, re-armed by the watcher while it runs, then dumps to the rank's
stderr (its log) and exits.

Standard library only; a no-op until :func:`watch` starts it (one per process).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from pipeline import error_record

EXIT_CODE = 3  # srun: "task N: Exited with exit code 3"
GRACE = 0.5  # x seconds: how much longer a rank waiting in a collective gives the stuck one
_ROOT = Path(__file__).resolve().parents[1]  # the checkout: pipeline/, launch/, data_prep/ are vitp's

_lock = threading.Lock()
_state = {"last": 0.0, "busy": 0, "startup": False, "watcher": None, "stop": None}
_COLLECTIVE = ("/torch/distributed/", "/deepspeed/comm/", "/pipeline/distributed.py")


def beat() -> None:
    """Progress: a step is done (two stores; every step calls it). The first one ends start-up."""
    _state["last"] = time.monotonic()
    _state["startup"] = False


@contextlib.contextmanager
def busy():
    """Work that keeps the rank alive however long it takes (periodic tasks, a checkpoint, a wait)."""
    with _lock:
        _state["busy"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["busy"] -= 1
            _state["last"] = time.monotonic()


def watch(folder: str | os.PathLike, rank: int, seconds: float) -> None:
    """Start watching this process (``seconds`` <= 0: not at all); start-up keeps it alive until the
    first :func:`beat`."""
    if seconds <= 0 or _state["watcher"] is not None:
        return
    stop_event = threading.Event()
    _state.update(last=time.monotonic(), startup=True, stop=stop_event)
    t = threading.Thread(target=_watch, args=(Path(folder), rank, float(seconds), stop_event),
                         name="vitp-hang-watch", daemon=True)
    _state["watcher"] = t
    t.start()


def stop() -> None:
    """No more steps to watch (the loop ended or stopped; what follows has its own timeouts)."""
    if _state["watcher"] is None:
        return
    _state["stop"].set()
    _state["watcher"].join()
    _state.update(watcher=None, stop=None)
    faulthandler.cancel_dump_traceback_later()


def where(frame) -> tuple[str, bool]:
    """("func (path:line)" of the innermost vitp frame of ``frame``'s stack (else the innermost frame),
    whether the stack waits in a collective)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    waiting = any(m in Path(f.f_code.co_filename).as_posix() for f in stack for m in _COLLECTIVE)
    for f in stack:
        path = Path(f.f_code.co_filename).resolve()
        if path.is_relative_to(_ROOT) and path.parts[len(_ROOT.parts)] in ("pipeline", "launch", "data_prep"):
            return f"{f.f_code.co_name} ({path.relative_to(_ROOT).as_posix()}:{f.f_lineno})", waiting
    f = stack[0]
    return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})", waiting


def _watch(folder: Path, rank: int, seconds: float, stopped: threading.Event) -> None:
    main = threading.main_thread().ident
    while not stopped.wait(min(1.0, seconds / 4)):  # the watch's own clock
        with _lock:
            if _state["busy"] or _state["startup"]:
                _state["last"] = time.monotonic()
            idle = time.monotonic() - _state["last"]
        frame = sys._current_frames().get(main)
        if frame is None:  # the main thread has ended
            return
        stuck_in, waiting = where(frame)
        limit = seconds * (1 + GRACE) if waiting else seconds
        faulthandler.dump_traceback_later(limit - idle + seconds, exit=True)  # the backstop, re-armed
        if idle > limit:
            _fire(folder, rank, idle, stuck_in, waiting)


def _fire(folder: Path, rank: int, idle: float, stuck_in: str, waiting: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    what = "waiting in a collective" if waiting else "stuck"
    line = f"hung: no progress for {idle:.0f}s, {what} in {stuck_in}; stacks in hang.{rank}.txt"
    with open(folder / f"hang.{rank}.txt", "w") as f:
        f.write(line + "\n\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    _dump_flight_recorder(folder, rank)
    error_record.write(folder, rank, line, retry=True, hang=True, frame=stuck_in, waiting=waiting)
    print(f"vitp: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def _dump_flight_recorder(folder: Path, rank: int) -> None:
    """NCCL's flight recorder, where it records (launch/job_body.py nccl_debug_env turns it on)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None:
        return
    try:
        (folder / f"nccl_trace_rank_{rank}").write_bytes(dump())
    except Exception as e:  # evidence is best effort: the stacks are written already
        print(f"vitp: no NCCL flight-recorder dump ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
