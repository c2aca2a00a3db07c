"""Remote shards as byte streams that survive network faults: retried, read ahead, counted.

A :class:`ShardStream` reads one object (``s3://``, ``gs://``, ``https://``) from a byte offset as a
sequence of ranged reads through ``data_prep.store.read_range``. A background thread fetches the next
blocks while the loader parses and decodes the current one (bounded: ``depth`` blocks wait at most),
so a worker does not wait one round trip per block, and the next shard's stream can be opened before
the current one ends (its first blocks arrive while this shard is consumed).

Faults, as :class:`ReadPolicy` (``data.read_timeout_s``, ``data.read_retries``, ``data.on_read_error``)
says: a reset connection, a 5xx/429 reply or a read that gets no bytes for ``timeout_s`` (the SDK's
read timeout) is retried with exponential backoff and jitter, reopening the object at the first byte
not yet delivered, so the consumer sees each byte once, in order. A try that fails part way keeps
what it received (the next ranged read starts after it) and is not counted as failed: only a try
that delivered nothing is, so a link that drops every few KiB still advances. After ``retries``
failed tries in a row the stream raises :class:`ShardReadError`; a missing object or a refused one
(404/403) is not retried. Stream shape::

    store.read_range(addr, pos, pos + block) ──blocks──▶ queue (≤ depth) ──read(n)──▶ tar parser ──▶ samples
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass

from data_prep import store

ON_READ_ERROR = ("skip", "stop")
BLOCK, DEPTH = 4 << 20, 2  # bytes per ranged read; blocks read ahead (a stream holds <= DEPTH + 1 blocks)
_BYTES = {"bytes": 0, "t0": None}  # this process's remote bytes read, and when the first read began


@dataclass(frozen=True)
class ReadPolicy:
    """How shard reads meet network faults (``data.read_timeout_s`` / ``read_retries`` / ``on_read_error``)."""

    timeout_s: float = 60.0
    retries: int = 5
    on_error: str = "skip"  # "skip": the shard's rest is skipped and counted; "stop": the run stops
    backoff_s: float = 0.25  # first wait; doubled per failed try, with jitter, capped
    backoff_cap_s: float = 10.0

    @classmethod
    def of(cls, cfg_data) -> ReadPolicy:
        """The data section's settings (defaults for a section without them)."""
        d = cls()
        return cls(float(getattr(cfg_data, "read_timeout_s", d.timeout_s)),
                   int(getattr(cfg_data, "read_retries", d.retries)),
                   str(getattr(cfg_data, "on_read_error", d.on_error)))

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed try in a row: exponential, capped, with
        jitter (so the workers of a job that all lost the same server do not come back in step)."""
        return min(self.backoff_cap_s, self.backoff_s * 2 ** (failures - 1)) * (0.5 + random.random() / 2)


class ShardReadError(OSError):
    """A shard that could not be read after the policy's retries; the message names its public address."""

    def __init__(self, address: str, why: str):
        super().__init__(f"{store.public(address)}: {why}")
        self.address = address


def io_stats() -> dict:
    """This process's remote read totals: {"bytes": n, "seconds": since its first remote read}."""
    t0 = _BYTES["t0"]
    return {"bytes": _BYTES["bytes"], "seconds": 0.0 if t0 is None else time.perf_counter() - t0}


def _fatal(e: BaseException) -> bool:
    """Errors another try cannot fix: the object is not there or we may not read it."""
    return isinstance(e, (FileNotFoundError, PermissionError, store.AddressError))


class ShardStream:
    """A remote object from byte ``start`` as a read-only stream (``read(n)``, ``close()``, a context
    manager). Memory is bounded by ``(depth + 1) × block`` bytes (module defaults BLOCK, DEPTH).
    ``end``: a tar read up to a sample's offset: no byte from there is asked for, and the stream ends
    with a tar end-of-archive marker, so the reader stops there as at an archive's end."""

    def __init__(self, address: str, start: int, policy: ReadPolicy, block: int | None = None,
                 depth: int | None = None, end: int | None = None):
        self.address, self.policy, self.block, self.end = address, policy, block or BLOCK, end
        depth = depth or DEPTH
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._buf, self._off, self._eof = b"", 0, False
        if _BYTES["t0"] is None:
            _BYTES["t0"] = time.perf_counter()
        self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True,
                                        name=f"shard-read {store.public(address)}")
        self._thread.start()

    # ── producer (background thread) ──
    def _produce(self, pos: int) -> None:
        failures = 0
        while not self._stop.is_set():
            got: list[bytes] = []  # what this try received, kept even when the try fails part way
            error, size = None, None
            try:
                hi = pos + self.block if self.end is None else min(pos + self.block, self.end)
                size = store.read_range(self.address, pos, hi, self.policy.timeout_s, got)
            except Exception as e:  # noqa: BLE001 (each SDK has its own errors; store.reason names them)
                error = e
            if got:
                b = got[0] if len(got) == 1 else b"".join(got)
                pos += len(b)
                _BYTES["bytes"] += len(b)
                self._put(b)
            if self.end is not None and pos >= self.end:
                self._put(b"\0" * 1024)  # two zero blocks: tar's end-of-archive marker
                self._put(b"")
                return
            if size is not None and pos >= size:
                self._put(b"")
                return
            if error is not None and _fatal(error):
                self._put(ShardReadError(self.address, f"unreadable at byte {pos} ({store.reason(error)})"))
                return
            if got:  # progress, even if the link then dropped: not a failure, the rest is asked for at once
                failures = 0
                continue
            failures += 1
            if failures > self.policy.retries:
                why = store.reason(error) if error is not None else "replies without a byte"
                self._put(ShardReadError(self.address, f"unreadable after {failures} tries at byte {pos} ({why})"))
                return
            self._stop.wait(self.policy.backoff(failures))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)  # wakes now and then to notice close()
                return
            except queue.Full:
                continue

    # ── consumer ──
    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the object); ShardReadError when retries ran out."""
        if n < 0:
            n = 1 << 62
        parts = []
        while n > 0:
            if self._off >= len(self._buf):
                if self._eof:
                    break
                item = self._q.get()
                if isinstance(item, BaseException):
                    self._eof = True
                    raise item
                if not item:
                    self._eof = True
                    break
                self._buf, self._off = item, 0
            chunk = self._buf[self._off:self._off + n]
            self._off += len(chunk)
            n -= len(chunk)
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._stop.set()
        try:  # unblock a producer waiting on a full queue
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

