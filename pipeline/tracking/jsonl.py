"""``RUN_DIR/metrics.jsonl``: one JSON object per logged step, ``{"step": N, <metric>: value, ...}``.

Rank 0 appends a line per ``log`` call and closes the file after each one, so a killed job loses
no record it logged. A resumed job first drops the records after the step it resumes from (it
runs those steps again and logs them anew), and any line a full disk or a crash cut short
(pipeline/files.py ``read_jsonl``): the file then equals an uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.files import append_jsonl, atomic_write, read_jsonl
from pipeline.tracking.sink import Sink

METRICS = "metrics.jsonl"


class JsonlSink(Sink):
    """Appends records to ``path``. An existing file is rewritten at the start (atomically, on stable
    storage before the first append) without the lines that are not JSON and, ``keep_up_to`` (a resumed
    run's step), without the records past it. ``records``: what the file holds, kept up to date in memory
    (the few-shot evaluators and the loss curve read it)."""

    def __init__(self, path: str | Path, keep_up_to: int | None = None):
        self.path = Path(path)
        self.records: list[dict] = []
        if self.path.is_file():
            self.records = [r for r in read_jsonl(self.path) if keep_up_to is None or r["step"] <= keep_up_to]
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in self.records), fsync=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        append_jsonl(self.path, [record])
