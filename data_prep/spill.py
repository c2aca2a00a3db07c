"""Order any number of records by a 64-bit key in bounded memory: a bucket sort through spill files.

Records are tuples whose first element is the key, an int in [0, 2**64). `add` puts each record in
one of 256 buckets by the key's top 8 bits, buffering at most `flush_records` in memory before
appending every bucket's records to its file. `sorted_runs` then yields the buckets in key order,
each sorted on its own; a bucket too large to sort in memory is split again by the next 8 bits (a
key is 8 such digits), so memory stays bounded by `max_sort_records` however many records there are
(except for records that share all 64 key bits: they are one bucket whatever its size).

The files are this process's own scratch (never read by anyone else), so they hold marshal blobs:
the standard library's fastest serialisation of plain tuples, str, int and None.
"""

from __future__ import annotations

import marshal
import os
import struct
from collections.abc import Iterator

BITS = 8
FLUSH_RECORDS = 100_000
MAX_SORT_RECORDS = 200_000  # ~40 MB of tuples being sorted, at most
_LEN = struct.Struct("<Q")


class Spill:
    def __init__(self, folder: str | os.PathLike, *, shift: int = 64, flush_records: int | None = None,
                 max_sort_records: int | None = None):
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.shift = shift  # this level's bucket is key bits [shift - 8, shift)
        self.flush_records = flush_records or FLUSH_RECORDS
        self.max_sort = max_sort_records or MAX_SORT_RECORDS
        self.buffers: list[list[tuple]] = [[] for _ in range(1 << BITS)]
        self.counts = [0] * (1 << BITS)
        self.buffered = 0

    def _path(self, b: int) -> str:
        return os.path.join(self.folder, f"{b:02x}.bin")

    def add_many(self, records: list[tuple]) -> None:
        low, mask, bufs = self.shift - BITS, (1 << BITS) - 1, self.buffers
        for rec in records:
            bufs[(rec[0] >> low) & mask].append(rec)
        self.buffered += len(records)
        if self.buffered >= self.flush_records:
            self.flush()

    def flush(self) -> None:
        for b, buf in enumerate(self.buffers):
            if buf:
                blob = marshal.dumps(buf)
                with open(self._path(b), "ab") as f:
                    f.write(_LEN.pack(len(blob)) + blob)
                self.counts[b] += len(buf)
                self.buffers[b] = []
        self.buffered = 0

    def _read(self, b: int) -> Iterator[list[tuple]]:
        with open(self._path(b), "rb") as f:
            while head := f.read(_LEN.size):
                yield marshal.loads(f.read(_LEN.unpack(head)[0]))

    def sorted_runs(self) -> Iterator[list[tuple]]:
        """Every record, as sorted lists (one per bucket) in key order; each bucket file is deleted once read."""
        self.flush()
        for b in range(1 << BITS):
            if not self.counts[b]:
                continue
            if self.counts[b] > self.max_sort and self.shift - BITS >= BITS:
                sub = Spill(os.path.join(self.folder, f"{b:02x}"), shift=self.shift - BITS,
                            flush_records=self.flush_records, max_sort_records=self.max_sort)
                for blob in self._read(b):
                    sub.add_many(blob)
                os.unlink(self._path(b))
                yield from sub.sorted_runs()
                continue
            run = [rec for blob in self._read(b) for rec in blob]
            os.unlink(self._path(b))
            run.sort()
            yield run
