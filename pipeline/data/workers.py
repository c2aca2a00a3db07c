"""Loader worker processes: how they start (:func:`init_worker`) and how they end, with their loader
(:func:`end_workers`) or with the process (an exit handler). Workers ignore SLURM's stop signals, so
each way they can be left behind ends them with KILL. Inside a worker: which one it is
(:func:`current`), what it sends with each batch (:func:`io_report`, :func:`wire`)."""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401  (its exit handler is registered before ours, so ours runs first)
import signal

import torch
from torch.utils.data import get_worker_info

from .stream import io_stats


def current() -> tuple[int, int]:
    """(this worker's id, number of workers); (0, 1) outside a DataLoader worker."""
    wi = get_worker_info()
    return (0, 1) if wi is None else (wi.id, wi.num_workers)


def io_report() -> tuple[int, int, float]:
    """(worker, remote bytes read, seconds since its first remote read): sent with each batch."""
    st = io_stats()
    return current()[0], st["bytes"], st["seconds"]


def wire(batch: tuple) -> tuple:
    """Worker side: every tensor after the first (the image batch) as a numpy array, pickled inline
    with the message. Each tensor sent from a worker is a shared-memory block whose descriptor the
    main process fetches over a socket (~0.5 ms of both processes' time), so only images go that way."""
    return tuple(x.numpy() if i and isinstance(x, torch.Tensor) else x for i, x in enumerate(batch))


def init_worker(_):
    torch.set_num_threads(1)  # decode/augment is per-sample; intra-op threads only fight each other
    # SLURM sends its stop signals (USR2 before the time limit or on preemption, TERM on scancel) to every
    # process of the task. They ask the main process to finish the step and save, which needs the workers
    # alive until then: torch's worker handler would die of TERM, and USR2's default action kills. The
    # workers still end with their loader, or with the main process (torch's parent watchdog), or by KILL.
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    """At interpreter exit multiprocessing terminates (SIGTERM) its daemonic children, loader workers
    among them, and then joins them: workers that ignore TERM would be waited for forever whenever a
    loader was not shut down before exit (its iterator in a reference cycle no collection freed yet,
    a stage leaving by an exception). So they get KILL instead, the same end. Registered after
    multiprocessing's own exit handler, so it runs first."""
    workers = [p for p in multiprocessing.active_children() if p.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report each as a crash
    for p in workers:
        p.kill()


atexit.register(_kill_workers_at_exit)


def end_workers(it) -> None:
    """Workers of a loader left before its end (a read error, a consumer that stops early) end now.
    They may be inside a fetch (a slow or refused read retrying), and they ignore TERM (init_worker),
    so torch's own shutdown would wait 2 x 5 s for each before giving up on it, whenever the iterator
    happens to be collected. They get KILL, as at exit (_kill_workers_at_exit); torch's shutdown then
    only reaps them. A loader that reached its end has shut its workers down already (nothing to do)."""
    if getattr(it, "_shutdown", True):
        return
    from torch.utils.data._utils import signal_handling

    if it._worker_pids_set:  # torch's SIGCHLD check would report each killed worker as a crash
        signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    for w in it._workers:
        w.kill()
    it._shutdown_workers()
