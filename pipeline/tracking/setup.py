"""What a stage calls to track a run in MLflow: the server's address, a check that it accepts us,
and the rank's MLflow sink (pipeline/tracking/mlflow_sink.py), from the stage's tracking section."""

from __future__ import annotations

import importlib
import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

from pipeline.tracking.mlflow_sink import MlflowSink
from pipeline.tracking.mlflow_store import TrackingAccessError, access_problem, source_tags
from pipeline.tracking.sink import Sink


class Tracking:
    """A stage's tracking, built once from its ``tracking`` section (and the run's name): the server's
    address, the access check at the start, and this rank's sinks. Every method is read from the
    section it was given; the stage hands it nothing more later."""

    def __init__(self, section, run_dir: str | os.PathLike, *, rank: int, run_name: str | None = None):
        self.cfg, self.run_dir, self.rank, self.run_name = section, Path(run_dir), rank, run_name

    @classmethod
    def from_config(cls, cfg, run_dir: str | os.PathLike, *, rank: int) -> Tracking:
        """From a stage config's ``tracking`` section and, where it has one (not `vitp eval`), ``run.name``."""
        run = getattr(cfg, "run", None)
        return cls(cfg.tracking, run_dir, rank=rank, run_name=run.name if run is not None else None)

    @property
    def uri(self) -> str:
        """tracking.uri, else $MLFLOW_TRACKING_URI, else a SQLite store in the run dir."""
        if self.cfg.uri:
            return self.cfg.uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{self.run_dir.resolve() / 'mlflow.db'}"

    def extra_sinks(self) -> list[Sink]:
        """Rank 0's ``tracking.sinks``: each "package.module:Class" built as ``Class(run_dir)``; none elsewhere.
        A name that does not resolve to a Sink subclass is a ConfigError naming it, on every rank alike."""
        from pipeline.config import ConfigError

        classes = []
        for name in self.cfg.sinks:
            module, _, attr = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr) if attr else None
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"tracking.sinks: {name!r}: {type(e).__name__}: {e}") from None
            if not (isinstance(cls, type) and issubclass(cls, Sink)):
                raise ConfigError(f"tracking.sinks: {name!r} is not a pipeline.tracking.Sink subclass "
                                  "(expected 'package.module:Class')")
            classes.append(cls)
        return [cls(self.run_dir) for cls in classes] if self.rank == 0 else []

    def check_access(self) -> None:
        """At a stage's start, on every rank: raise :class:`TrackingAccessError` (on all ranks alike) when
        the server refuses rank 0's credentials, before anything trains for nothing."""
        from pipeline.distributed import all_gather_object, wait_for_rank0

        problem = None
        if self.rank == 0 and self.cfg.enabled:
            problem = access_problem(self.uri, self.cfg.experiment)
        wait_for_rank0()  # rank 0's requests run outside any collective's timeout
        problem = all_gather_object(problem)[0]
        if problem:
            raise TrackingAccessError(problem)

    def mlflow(self, *, world_size: int, stage: str, run_id: str | None = None, run_key: str | None = None,
               params: dict[str, Any] | None = None, datasets: list[dict] | None = None,
               uri: str | None = None, parent_run_id: str | None = None, run_name: str | None = None,
               experiment: str | None = None) -> Sink:
        """This process's MLflow sink: a real one on rank 0 when tracking is enabled, else a :class:`Sink`
        that does nothing.

        A resumed job passes the ``run_id`` (and ``run_key``) its checkpoint recorded to continue that run.
        ``datasets``: pipeline.data.dataset_inputs(...) of what the stage reads. ``uri``/``parent_run_id``:
        an evaluation nests its run under the evaluated one, in that run's store.
        """
        if self.rank != 0 or not self.cfg.enabled:
            return Sink()
        run_dir = self.run_dir
        uri = uri or self.uri
        local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
        tags = {"stage": stage, "host": socket.gethostname(), "world_size": world_size, **source_tags(stage)}
        if os.environ.get("SLURM_JOB_ID"):
            tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        # a launcher's shared tags, e.g. every task of a sweep array: {"sweep": "<id>", "sweep_index": 3}
        try:
            tags.update(json.loads(os.environ.get("VITP_MLFLOW_TAGS") or "{}"))
        except json.JSONDecodeError:
            warnings.warn("VITP_MLFLOW_TAGS is not a JSON object; ignored", stacklevel=2)
        sink = MlflowSink(uri, experiment=experiment or self.cfg.experiment,
                          run_name=run_name or self.run_name or run_dir.name,
                          spool_dir=run_dir, run_id=run_id, run_key=run_key, params=params, tags=tags,
                          flush_every_s=self.cfg.flush_every_s,
                          parent_run_id=parent_run_id or getattr(self.cfg, "parent_run", None),
                          artifact_location=(run_dir.resolve() / "mlartifacts").as_uri() if local else None,
                          system_metrics_every_s=(self.cfg.system_metrics_every_s if self.cfg.system_metrics
                                                  else None))
        sink.log_inputs(datasets or [])
        return sink

