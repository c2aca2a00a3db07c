"""One interface for everywhere a run's records go, and a container that fans out to several.

A sink takes what a run reports: ``log(metrics, step)`` (numbers at a step), ``set_tags``,
``log_artifact`` (a file), ``log_table`` (rows), ``log_inputs`` (the datasets read), ``log_model``,
and ``close(status)`` at the end. The base class does nothing, so a sink implements only what it
keeps (the JSONL file keeps metrics; MLflow keeps everything) and ranks other than 0 get an empty
container. Adding a destination is one subclass in one file, handed to :class:`Sinks`.
"""

from __future__ import annotations

import os
from typing import Any


class Sink:
    """Where a run's records go; every method is a no-op here. ``run_id``/``run_key``/``uri``: the
    tracking run this sink writes to, recorded in checkpoints so a resumed job continues it (None
    for a sink without runs)."""

    run_id: str | None = None
    run_key: str | None = None
    uri: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """``metrics`` (name -> number, None for "not measured") at optimizer step ``step``."""

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        """``rows``, one dict per row, as a table named ``artifact_file`` (e.g. ``per_class_val.json``)."""

    def log_inputs(self, datasets: list[dict]) -> None:
        """Datasets read: dicts with name, digest, source_type, source, schema, profile, context
        (pipeline.data.dataset_inputs makes them)."""

    def log_model(self, model, input_example=None, registered_name: str | None = None) -> None:
        """The final model, ``input_example`` an image batch [N, 3, H, W] (N >= 2, float32)."""

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until what was logged so far is stored; False if ``timeout`` passed first."""
        return True

    def close(self, status: str | None = None, timeout: float = 30.0) -> None:
        """The run ends: ``status`` "FINISHED" or "FAILED"; None when a requeued job continues it.
        Waits at most ``timeout`` seconds for what is still in flight."""


class Sinks(Sink):
    """Fans every call out to its sinks, in order. ``run_id``/``run_key``/``uri`` are the first
    sink's that has a run (the MLflow run). ``Sinks()`` (ranks other than 0) does nothing."""

    def __init__(self, *sinks: Sink | None):
        self.sinks = [s for s in sinks if s is not None]

    def _first(self, name: str) -> str | None:
        return next((v for s in self.sinks if (v := getattr(s, name)) is not None), None)

    @property
    def run_id(self) -> str | None:
        return self._first("run_id")

    @property
    def run_key(self) -> str | None:
        return self._first("run_key")

    @property
    def uri(self) -> str | None:
        return self._first("uri")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for s in self.sinks:
            s.log(metrics, step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for s in self.sinks:
            s.set_tags(tags)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        for s in self.sinks:
            s.log_artifact(path, artifact_path)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        for s in self.sinks:
            s.log_table(rows, artifact_file)

    def log_inputs(self, datasets: list[dict]) -> None:
        for s in self.sinks:
            s.log_inputs(datasets)

    def log_model(self, model, input_example=None, registered_name: str | None = None) -> None:
        for s in self.sinks:
            s.log_model(model, input_example, registered_name)

    def flush(self, timeout: float = 30.0) -> bool:
        return all([s.flush(timeout) for s in self.sinks])  # a list: every sink flushes

    def close(self, status: str | None = None, timeout: float = 30.0) -> None:
        for s in self.sinks:
            s.close(status, timeout)
