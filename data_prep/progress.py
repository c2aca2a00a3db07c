"""A small progress line on stderr: images/s, rejects, ETA. Redraws in place on a terminal, else logs every 10 s."""

from __future__ import annotations

import sys
import time


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int, enabled: bool = True, label: str = "prep"):
        self.total, self.enabled, self.label = total, enabled, label
        self.done = self.rejects = 0
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, n: int, rejects: int = 0) -> None:
        self.done += n
        self.rejects += rejects
        now = time.perf_counter()
        if self.enabled and now - self.last >= (0.2 if self.tty else 10.0):
            self.last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        line = (f"[{self.label}] {self.done}/{self.total} images  {rate:.1f} img/s  "
                f"rejects {self.rejects}  ETA {_hms(eta)}")
        sys.stderr.write(("\r" + line + end) if self.tty else (line + "\n"))
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.total:
            self._draw(time.perf_counter(), end="\n")
