"""``RUN_DIR/metrics.jsonl``: one JSON object per logged step, ``{"step": N, <metric>: value, ...}``.

Rank 0 appends a line per ``log`` call and closes the file after each one, so a killed job loses
no record it logged. A resumed job first drops the records after the step it resumes from (it
runs those steps again and logs them anew): the file then equals an uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.files import atomic_write, read_jsonl
from pipeline.tracking.sink import Sink

METRICS = "metrics.jsonl"


class JsonlSink(Sink):
    """Appends records to ``path``. ``keep_up_to``: a resumed run's step; records past it are dropped
    (rewritten atomically). ``records``: what the file holds, kept up to date in memory (the few-shot
    evaluators and the loss curve read it)."""

    def __init__(self, path: str | Path, keep_up_to: int | None = None):
        self.path = Path(path)
        self.records: list[dict] = []
        if self.path.is_file():
            self.records = list(read_jsonl(self.path))
            if keep_up_to is not None:
                self.records = [r for r in self.records if r["step"] <= keep_up_to]
                atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
