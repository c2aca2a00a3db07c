"""The MLflow sink: tracking that never slows or stops training. With mlflow_store.py (requests, spool,
access checks) the only modules that import mlflow.

Rank 0 gets a :class:`MlflowSink` (pipeline/tracking/setup.py starts it); other ranks get none.
Calls only enqueue ops (``run``: create or continue a run, found again by its ``vitp_run_key`` tag;
``metric``, ``tags``, ``inputs``, ``artifact``, ``table``, ``end``); one background thread sends
them in order. While the server is down they wait in memory (a warning says so); what is still
undelivered ``tracking.close_timeout_s`` after the end goes to ``RUN_DIR/mlflow_spool.jsonl``,
which ``vitp sync RUN_DIR`` (:meth:`MlflowSink.sync`) or the next job in that run dir delivers. A re-sent
record lands once: a metric keeps its timestamp (the store drops an identical point), the rest
overwrite themselves. Runs carry MLflow's standard source tags, their datasets as dataset inputs,
and ``system/...`` metrics from MLflow's own monitors (GPUs where NVML, ``nvidia-ml-py``, finds any).

Default store: ``sqlite:///RUN_DIR/mlflow.db`` (artifacts in RUN_DIR/mlartifacts);
``$MLFLOW_TRACKING_URI`` or ``tracking.uri`` point elsewhere (e.g. ``http://127.0.0.1:5000``).

Logins: MLflow's own variables (MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN, and for TLS
MLFLOW_TRACKING_SERVER_CERT_PATH, _INSECURE_TLS, _CLIENT_CERT_PATH) hold for every request, ours
included. A refusal (HTTP 401/403, a TLS verification failure) is a configuration error, not an
outage: :func:`access_problem` finds it before a job is queued or a stage trains, and a refusal
mid-run (an expired token) is reported once and stops delivery (records spool for `vitp sync`);
only connection failures and 5xx/429 are retried. A URI is connected with as given and written
or shown only redacted (pipeline/secrets.py).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.files import read_jsonl
from pipeline.secrets import redact
from pipeline.tracking.mlflow_store import SPOOL, Delivery, refusal
from pipeline.tracking.sink import Sink


class MlflowSink(Delivery, Sink):
    """Asynchronous MLflow run. ``run_id`` given: continue that run (params are not logged again).
    ``parent_run_id``: nest the new run under that one, in its experiment.
    ``system_metrics_every_s``: sample MLflow's system metrics that often (None: off)."""

    def __init__(self, uri: str, *, experiment: str, run_name: str, spool_dir: str | os.PathLike,
                 run_id: str | None = None, run_key: str | None = None,
                 params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
                 flush_every_s: float = 2.0, artifact_location: str | None = None,
                 parent_run_id: str | None = None, system_metrics_every_s: float | None = None):
        super().__init__(uri, spool_dir)
        self.experiment, self.run_name = experiment, run_name
        self.run_id = run_id
        # identifies our run across retries: a create_run whose reply timed out may still have
        # made the run, and a retry must find it rather than make a second one
        self.run_key = run_key or uuid.uuid4().hex
        self._own = {"op": "run", "run_key": self.run_key, "run_id": run_id, "resume": run_id is not None,
                     "uri": self.uri, "experiment": experiment, "run_name": run_name,
                     "parent_run_id": parent_run_id,
                     "params": {k: redact(str(v))[:6000] for k, v in (params or {}).items()},
                     "tags": {k: redact(str(v)) for k, v in (tags or {}).items()},
                     "artifact_location": artifact_location}
        self._every, self._sys_every = flush_every_s, system_metrics_every_s
        self._sys_next: int | None = None  # the run's next system-metrics step, once the run is known
        self._q: queue.Queue = queue.Queue()
        self._count = threading.Lock()
        self._pending = [self._own, *self._claim_spool()]  # our run first, then what earlier jobs left
        self._queued = len(self._pending)  # flush waits for delivered >= queued
        self._down_since: float | None = None
        self._idle = threading.Event()
        self._wake = threading.Event()  # flush/close: deliver now rather than at the next tick
        self._stop = threading.Event()
        self._closed = False
        self._refused: str | None = None  # why the server refused us; nothing more is sent then
        try:  # create/continue the run now, so the first checkpoint can record its id
            with self._lock:
                self._deliver(limit=1)
        except Exception as e:  # down at start: the thread keeps trying
            if not self._refuse(e):
                self._down_since = time.monotonic()
                warnings.warn(f"MLflow at {self.uri} unreachable ({type(e).__name__}); training continues, "
                              "metrics are buffered", stacklevel=2)
        self._thread = threading.Thread(target=self._run, name="mlflow-tracker", daemon=True)
        self._thread.start()
        self._sampler = (_SystemMetrics(self._log_system, self.run_id, self._uri, system_metrics_every_s)
                         if system_metrics_every_s else None)
        atexit.register(self._at_exit)

    # ---- the spool, for `vitp sync` and `vitp jobs` ------------------------------------------------
    @staticmethod
    def sync(run_dir: str | os.PathLike, uri: str | None = None, timeout: float = 60.0) -> dict:
        """Deliver ``RUN_DIR/mlflow_spool.jsonl``: each record once, each run ended as it ended.

        -> {"delivered": n, "left": n (kept in the spool), "runs": {run_id: status}, "uri": uri, "error"}.
        The server comes from the spool (``uri`` overrides); the spool names it redacted, so the login
        comes from MLflow's variables (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN) as they are now.
        """
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"{run_dir}: no such run directory")
        return Delivery(uri or "", run_dir).deliver_spool(uri, timeout)

    @staticmethod
    def spooled(run_dir: str | os.PathLike) -> int:
        """How many records (metrics, tags, artifacts, run ends) wait in ``RUN_DIR/mlflow_spool.jsonl``."""
        try:
            ops = read_jsonl(Path(run_dir) / SPOOL)
        except OSError:
            return 0
        return sum(1 for op in ops if op.get("op") != "run")

    @staticmethod
    def outcome(run_dir: str | os.PathLike) -> str:
        """One line saying what tracking did for a finished job's run dir: delivered, or how many
        records wait and the `vitp sync` command that delivers them."""
        n = MlflowSink.spooled(run_dir)
        if n:
            return f"tracking: {n} records spooled in {Path(run_dir) / SPOOL}; deliver them with `vitp sync {run_dir}`"
        return "tracking: delivered"

    # ---- the training side: enqueue only ----------------------------------------------------------
    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is not None:
                self._put({"op": "metric", "key": k, "value": float(v), "step": int(step), "ts": ts})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._put({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        """``rows`` (one dict per row) in MLflow's table format, so the UI shows a table."""
        self._put({"op": "table", "rows": rows, "artifact_file": artifact_file})

    def log_inputs(self, datasets: list[dict]) -> None:
        if datasets:
            self._put({"op": "inputs", "datasets": [{k: redact(v) for k, v in d.items()} for d in datasets]})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._put({"op": "tags", "tags": {k: redact(str(v)) for k, v in tags.items()}})

    def _put(self, op: dict) -> None:
        with self._count:
            self._queued += 1
        self._q.put(dict(op, run_key=self.run_key))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far is delivered; False if the deadline passes first."""
        target, deadline = self._queued, time.monotonic() + timeout
        while self._delivered < target or self.run_id is None:
            self._wake.set()
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            self._idle.wait(0.2)
            self._idle.clear()
        return True

    def close(self, status: str | None = None, timeout: float = 30.0) -> None:
        """Deliver what we can within ``timeout``; spool the rest for `vitp sync` or a later job.

        ``status`` ("FINISHED", "FAILED"): end the MLflow run; None leaves it running (a stopped
        job that will be requeued continues it)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if self._sampler is not None:
            self._sampler.stop()  # its last sample goes in before the run ends
        if status is not None:
            self._put({"op": "end", "status": status, "ts": int(time.time() * 1000)})
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(1.0, self._every * 2))
        with self._lock:  # waits out a request still in flight: nothing is both sent and spooled
            self._drain()
            header = None if self._pending and self._pending[0] is self._own else \
                {"op": "run", "run_key": self.run_key, "run_id": self.run_id, "uri": self.uri}
            n = self._write_spool(header)
        if n and self._refused:
            warnings.warn(f"{self._refused}: {self.spooled(self._spool.parent)} records kept in {self._spool}; deliver "
                          f"them with `vitp sync {self._spool.parent}` once the credentials are fixed", stacklevel=2)
        elif n:
            warnings.warn(f"MLflow at {self.uri} unreachable: {self.spooled(self._spool.parent)} records kept in "
                          f"{self._spool}; deliver them with `vitp sync {self._spool.parent}` once it is back (a job "
                          "that continues this run dir also does)", stacklevel=2)

    def _at_exit(self) -> None:
        """The process ends without close(): the run failed (an exception); say so, briefly."""
        self.close(status="FAILED", timeout=10.0)

    def log_model(self, model, input_example=None, registered_name: str | None = None) -> None:
        """Log ``model`` with the mlflow.pytorch flavour (and register it); synchronous, warns on failure.

        ``input_example``: an image batch [N, 3, H, W] (N >= 2, float32). The signature says
        [-1, 3, H, W] -> [-1, K], so the exported program (and pyfunc ``predict``) takes any batch size.
        """
        if not self.flush(60.0):
            why = "refused us" if self._refused else "unreachable"
            warnings.warn(f"MLflow {why}: model not logged (weights are in the run dir)", stacklevel=2)
            return
        import mlflow
        import mlflow.pytorch
        import numpy as np
        import torch
        from mlflow.models import ModelSignature
        from mlflow.types import Schema, TensorSpec

        try:
            x = np.asarray(input_example, dtype=np.float32)
            with torch.no_grad():
                out = model(torch.from_numpy(x))
            spec = lambda shape: Schema([TensorSpec(np.dtype(np.float32), (-1, *shape[1:]))])  # noqa: E731
            with self._lock:
                mlflow.set_tracking_uri(self._uri)
                with mlflow.start_run(run_id=self.run_id):
                    mlflow.pytorch.log_model(model, name="model", input_example=x,
                                             signature=ModelSignature(spec(x.shape), spec(tuple(out.shape))),
                                             registered_model_name=registered_name)
        except Exception as e:  # tracking must never end training
            warnings.warn(f"MLflow log_model failed: {redact(str(e))}", stacklevel=2)

    # ---- the background thread ---------------------------------------------------------------------
    def _opened(self, op: dict) -> None:
        if op is self._own:
            self.run_id = self._runs[self.run_key]
            if op["resume"] and self._sys_every:  # continue MLflow's system-metrics steps
                last = [m.step for m in self._client.get_run(self.run_id).data._metric_objs
                        if m.key.startswith("system/")]
                self._sys_next = max(last, default=-1) + 1
            else:
                self._sys_next = 0

    def _own_run_id(self) -> str | None:
        return self.run_id

    def _log_system(self, metrics: dict[str, float]) -> bool:
        """One system-metrics sample as ``system/...`` at the next sample step; False while the run is
        not known yet (its steps continue the run's, so the sample waits and aggregates)."""
        if self._sys_next is None:
            return False
        self.log({f"system/{k}": v for k, v in metrics.items()}, self._sys_next)
        self._sys_next += 1
        return True

    def _refuse(self, e: BaseException) -> bool:
        """A refusal (login, permission, TLS): say so once, loudly, and send nothing more (retrying a
        refused login helps nobody and may lock the account); the records spool at close."""
        why = refusal(e, self._uri, self.experiment)
        if why is None:
            return False
        self._refused = why
        print(f"ERROR: {why}. Training continues; tracking records are kept and spooled at the end for "
              f"`vitp sync {self._spool.parent}`", file=sys.stderr, flush=True)
        return True

    def _drain(self) -> None:
        while True:
            try:
                self._pending.append(self._q.get_nowait())
            except queue.Empty:
                return

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set() and not self._refused:
            self._wake.wait(self._every)  # batch whatever arrived meanwhile into few requests
            self._wake.clear()
            self._drain()
            with self._lock:  # a refusal is announced before close() may take the lock and spool
                try:
                    self._deliver()
                    e = None
                except Exception as failed:  # server down or slow: keep the records, retry later
                    e = failed
                    if self._refused or self._refuse(e):
                        return  # close() spools what is pending; flush sees this thread gone
            if e is not None:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    warnings.warn(f"MLflow at {self.uri} unreachable ({type(e).__name__}: {redact(str(e))[:200]}); "
                                  "training continues, metrics are buffered", stacklevel=1)
                self._stop.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, 10.0)
                continue
            if self._down_since is not None:
                print(f"MLflow back after {time.monotonic() - self._down_since:.0f}s; buffered metrics "
                      "delivered", flush=True)
                self._down_since = None
            backoff = 0.5
            self._idle.set()


class _SystemMetrics:
    """MLflow's own system-metrics monitors, sampled every ``every`` seconds on rank 0 and handed to
    ``publish`` (the sink's queue, so they outlive an outage like any metric, where MLflow's
    SystemMetricsMonitor thread stops for good). Steps count samples, as MLflow's do. ``publish``
    returns False while the run is not known yet: the samples then aggregate until it is."""

    def __init__(self, publish: Callable[[dict[str, float]], bool], run_id: str | None, uri: str, every: float):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._publish_to, self._every = publish, every
        self._monitor = SystemMetricsMonitor(run_id, sampling_interval=every, tracking_uri=uri)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlflow-system-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._monitor.collect_metrics()
            stopping = self._stopping.wait(self._every)
            self._publish()
            if stopping:
                return

    def _publish(self) -> None:
        metrics = self._monitor.aggregate_metrics()
        if metrics and self._publish_to(metrics):
            for m in self._monitor.monitors:
                m.clear_metrics()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30.0)
