"""Prep's progress on stderr (tqdm): images, img/s, rejects, ETA. Redraws in place on a terminal;
in a log file (a SLURM task) one line every 10 s instead of a carriage-return storm."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, enabled: bool = True, label: str = "prep"):
        self.total, self.enabled = total, enabled
        self.done = self.rejects = 0
        tty = sys.stderr.isatty()
        self._bar = tqdm(total=total, desc=f"[{label}]", unit="img", file=sys.stderr, dynamic_ncols=tty,
                         mininterval=0.2 if tty else 10.0, disable=not enabled or not total,
                         bar_format="{desc} {n_fmt}/{total_fmt} images  {rate_fmt}{postfix}  ETA {remaining}"
                         + ("\n" if not tty else ""))

    def update(self, n: int, rejects: int = 0) -> None:
        self.done += n
        self.rejects += rejects
        if rejects:
            self._bar.set_postfix_str(f"rejects {self.rejects}", refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.set_postfix_str(f"rejects {self.rejects}", refresh=False)
        self._bar.close()
