"""Getting a checkpoint to disk without stopping training: a host copy of the states, written by a
background thread (pipeline/train/checkpoint.py's manager decides what and when).

    HostCopy     the states' tensors copied to host memory (pinned where they live on a GPU), into
                 buffers kept from one save to the next: one snapshot per rank at most
    Background   one write at a time in a thread; its failure kept as one line for the loop to act on
    host_room    whether this node's free memory holds every local rank's snapshot
    without_crc  torch.save as the writer calls it

Why a copy and not the live tensors: the optimizer updates its fp32 master weights and Adam moments
in place at the next step, while the thread is still writing them; a copy is what the step saved.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


class HostCopy:
    """Copies of a state's tensors in host memory. The buffers of one save are reused by the next
    (same shapes and dtypes in the same order: the same run's states), so a save allocates nothing
    after the first: allocating (and on a GPU pinning) gigabytes is slower than copying them.
    The caller must not copy again while the previous copy is being written."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self._next = 0
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._cuda = False

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def __call__(self, obj):
        """``obj`` (nested dicts, lists, tuples) with every tensor replaced by its host copy; other
        values are kept as they are (numbers, strings: nothing the step changes in place). A tensor
        met twice is copied once. Call :meth:`done` once every part of the save is copied."""
        if torch.is_tensor(obj):
            return self._tensor(obj)
        if isinstance(obj, dict):
            out = obj.copy()  # keeps the mapping's type (OrderedDict: DeepSpeed's module state)
            for k, v in obj.items():
                out[k] = self(v)
            return out
        if isinstance(obj, list):
            return [self(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self(v) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj  # nothing to copy inside (torch.Size: DeepSpeed's parameter shapes) keeps its type
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return obj

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self._memo:  # the memo holds ``t`` itself: its id stays its own until done()
            return self._memo[id(t)][1]
        key, t = t, t.detach()
        i, self._next = self._next, self._next + 1
        pin = t.device.type == "cuda"
        self._cuda |= pin
        if i < len(self.buffers) and self.buffers[i].shape == t.shape and self.buffers[i].dtype == t.dtype:
            buf = self.buffers[i]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.buffers[i:i + 1] = [buf]
        buf.copy_(t, non_blocking=pin)
        self._memo[id(key)] = (key, buf)
        return buf

    def done(self) -> None:
        """The copies are complete (a GPU's asynchronous ones waited for); the next save starts over."""
        if self._cuda:
            torch.cuda.synchronize()
        del self.buffers[self._next:]  # a state that shrank: no stale buffer kept
        self._next, self._memo, self._cuda = 0, {}, False


class Background:
    """One job at a time in a thread. ``run(job)`` starts it (``inline``: runs it here); a job returns
    None or the one-line reason it failed, kept in :attr:`error`. ``wait`` joins the running one."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.cpu_s: float | None = None  # the CPU time the last job took from its thread (bench/checkpoint.py)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, job: Callable[[], str | None], *, inline: bool, name: str = "vitp-checkpoint") -> None:
        self.wait()
        if inline:
            self._record(job)
            return
        # a daemon: a process that dies (an error all ranks agreed on) does not wait for a write that
        # can no longer be published; the end of a run and a stop wait for it explicitly
        self._thread = threading.Thread(target=self._record, args=(job,), name=name, daemon=True)
        self._thread.start()

    def _record(self, job: Callable[[], str | None]) -> None:
        _lower_priority()
        began = time.thread_time()
        try:
            err = job()
        except BaseException as e:  # a bug in the job: still one line, and the loop stops on it
            err = f"checkpoint write failed: {type(e).__name__}: {e}"
        self.cpu_s = time.thread_time() - began
        if err and self.error is None:
            self.error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _lower_priority() -> None:
    """The writer thread yields the CPU to the training threads (Linux: policy and niceness are per
    thread): SCHED_IDLE runs it only on a core nothing else wants; where that is refused, niceness 19."""
    if threading.current_thread() is threading.main_thread():
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass


def available_host_bytes() -> int | None:
    """This node's MemAvailable (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_room(snapshot_bytes: int, local_ranks: int, available: int | None = None, margin: float = 0.8) -> bool:
    """Whether ``local_ranks`` snapshots of ``snapshot_bytes`` fit in ``margin`` of the node's free
    host memory (``available``, default :func:`available_host_bytes`; unknown: assumed to fit)."""
    available = available_host_bytes() if available is None else available
    return available is None or snapshot_bytes * local_ranks <= margin * available


def without_crc():
    """torch.save without the CRC32 of each record: computing it took 4/5 of a save's CPU time here
    (1.6 s of 2 s for 400 MB) and torch.load never checks it (a flipped byte loads silently: measured
    with torch 2.14); a checkpoint's files are checked by their sizes in the manifest instead."""
    from torch.utils.serialization import config

    return config.patch({"save.compute_crc32": False})


def free_space(folder: Path) -> str:
    """The free space of ``folder``'s file system, for an error line."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
    except OSError as e:
        return f"unknown ({e.strerror})"
