"""MLflow tracking that never slows or stops training: the only module that imports mlflow.

Rank 0 gets a :class:`Tracker`; other ranks get a :class:`NullTracker` with the same methods.
Calls only enqueue; one background thread turns the queue into ``log_batch`` requests. When the
server is down or slow, records wait in memory (a warning says so) and go out when it returns;
on close, whatever is still undelivered after a bounded wait is appended to a spool file
(``RUN_DIR/mlflow_spool.jsonl``) that the next tracker for that run dir delivers first.

Default store: ``sqlite:///RUN_DIR/mlflow.db`` (artifacts in RUN_DIR/mlartifacts);
``$MLFLOW_TRACKING_URI`` or ``tracking.uri`` point elsewhere (e.g. ``http://127.0.0.1:5000``).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

# Fail fast and let our thread retry: mlflow's own retries would stall the queue for minutes.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

SPOOL = "mlflow_spool.jsonl"
_BATCH = 1000  # mlflow's limit of metrics per log_batch


def resolve_uri(cfg, run_dir: str | os.PathLike) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class NullTracker:
    """What ranks other than 0 (and tracking.enabled=false) get: every call does nothing."""

    run_id: str | None = None
    run_key: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_model_pytorch(self, model, input_example=None, registered_name: str | None = None) -> None: ...
    def flush(self, timeout: float = 30.0) -> bool:
        return True
    def close(self, timeout: float = 30.0, status: str | None = None) -> None: ...


class Tracker(NullTracker):
    """Asynchronous MLflow run. ``run_id`` given: continue that run (params are not logged again)."""

    def __init__(self, uri: str, *, experiment: str, run_name: str, spool_dir: str | os.PathLike,
                 run_id: str | None = None, run_key: str | None = None,
                 params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
                 flush_every_s: float = 2.0, artifact_location: str | None = None):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.run_id = run_id
        # identifies our run across retries: a create_run whose reply timed out may still have
        # made the run, and a retry must find it rather than make a second one
        self.run_key = run_key or uuid.uuid4().hex
        self._params, self._tags = params or {}, {k: str(v) for k, v in (tags or {}).items()}
        self._artifact_location = artifact_location
        self._spool = Path(spool_dir) / SPOOL
        self._every = flush_every_s
        self._q: queue.Queue = queue.Queue()
        self._pending: list[dict] = self._read_spool()  # ops in order: metric | artifact | tags
        self._queued, self._delivered = len(self._pending), 0  # flush waits for delivered >= queued
        self._client = None
        self._rest = None  # host credentials when the store is a server: metrics go to its REST API
        self._down_since: float | None = None
        self._idle = threading.Event()
        self._wake = threading.Event()  # flush/close: deliver now rather than at the next tick
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one mlflow request at a time (thread vs. log_model_pytorch)
        try:  # create/continue the run now, so the first checkpoint can record its id
            self._connect()
        except Exception as e:  # down at start: the thread keeps trying
            self._down_since = time.monotonic()
            warnings.warn(f"MLflow at {uri} unreachable ({type(e).__name__}); training continues, "
                          "metrics are buffered", stacklevel=2)
        self._thread = threading.Thread(target=self._run, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # ---- the training side: enqueue only ----------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is not None:
                self._put({"op": "metric", "key": k, "value": float(v), "step": int(step), "ts": ts})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._put({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._put({"op": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def _put(self, op: dict) -> None:
        self._queued += 1
        self._q.put(op)

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

    def close(self, timeout: float = 30.0, status: str | None = None) -> None:
        """Deliver what we can within ``timeout``; spool the rest for a later run to deliver.

        ``status`` ("FINISHED", "FAILED"): end the MLflow run; None leaves it running (a stopped
        job that will be requeued continues it)."""
        if status is not None:
            self._put({"op": "end", "status": status})
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(1.0, self._every * 2))
        self._drain()
        if self._pending:
            with open(self._spool, "a") as f:
                for op in self._pending:
                    f.write(json.dumps(dict(op, run_id=op.get("run_id") or self.run_id)) + "\n")
            warnings.warn(f"MLflow at {self.uri} unreachable: {len(self._pending)} records kept in "
                          f"{self._spool}; the next run in this dir delivers them", stacklevel=2)
            self._pending = []

    def log_model_pytorch(self, model, input_example=None, registered_name: str | None = None) -> None:
        """Log ``model`` with the mlflow.pytorch flavour (and register it); synchronous, warns on failure."""
        if not self.flush(60.0):
            warnings.warn("MLflow unreachable: model not logged (weights are in the run dir)", stacklevel=2)
            return
        import mlflow
        import mlflow.pytorch

        try:
            with self._lock:
                mlflow.set_tracking_uri(self.uri)
                with mlflow.start_run(run_id=self.run_id):
                    mlflow.pytorch.log_model(model, name="model", input_example=input_example,
                                             registered_model_name=registered_name)
        except Exception as e:  # tracking must never end training
            warnings.warn(f"MLflow log_model failed: {e}", stacklevel=2)

    # ---- the background thread ---------------------------------------------------------------------
    def _read_spool(self) -> list[dict]:
        if not self._spool.is_file():
            return []
        ops = [json.loads(line) for line in self._spool.read_text().splitlines() if line.strip()]
        self._spool.unlink()
        return ops

    def _drain(self) -> None:
        while True:
            try:
                self._pending.append(self._q.get_nowait())
            except queue.Empty:
                return

    def _connect(self) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        if self._client is None:
            self._client = MlflowClient(self.uri)
            if self.uri.startswith(("http://", "https://")):
                from mlflow.utils.credentials import get_default_host_creds

                self._rest = get_default_host_creds(self.uri)  # auth and TLS settings, as the client's
        c = self._client
        if self.run_id is not None:
            if self._tags:
                c.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self._tags.items()])
                self._tags = {}
            return
        exp = c.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(
            self.experiment, artifact_location=self._artifact_location)
        found = c.search_runs([exp_id], filter_string=f"tags.vitp_run_key = '{self.run_key}'", max_results=1)
        if found:
            self.run_id, self._tags = found[0].info.run_id, {}
            return
        run = c.create_run(exp_id, run_name=self.run_name, tags={**self._tags, "vitp_run_key": self.run_key})
        self._tags = {}
        params = [Param(k, str(v)[:6000]) for k, v in self._params.items()]
        for i in range(0, len(params), 100):
            c.log_batch(run.info.run_id, params=params[i:i + 100])
        self.run_id = run.info.run_id

    def _deliver(self) -> None:
        from mlflow.entities import RunTag

        while self._pending:
            op = self._pending[0]
            run_id = op.get("run_id") or self.run_id
            if op["op"] == "metric":
                n = 0
                while (n < min(len(self._pending), _BATCH) and self._pending[n]["op"] == "metric"
                       and (self._pending[n].get("run_id") or self.run_id) == run_id):
                    n += 1
                self._log_metrics(run_id, self._pending[:n])
            elif op["op"] == "artifact":
                n = 1
                if Path(op["path"]).exists():
                    self._client.log_artifact(run_id, op["path"], op.get("artifact_path"))
            elif op["op"] == "end":
                n = 1
                self._client.set_terminated(run_id, op["status"])
            else:
                n = 1
                self._client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()])
            del self._pending[:n]
            self._delivered += n

    def _log_metrics(self, run_id: str, ops: list[dict]) -> None:
        """One log_batch request. To a server, the JSON is written here and posted with mlflow's
        http_request (its auth, TLS and timeout settings): MlflowClient.log_batch builds and validates
        an entity and a protobuf message per metric first, 2.6x the CPU (8.2 vs 3.1 ms for 225
        metrics), which at log_every=1 was most of what tracking cost the trainer (bench/tracking.py)."""
        if self._rest is None:  # a local store (sqlite, file): only the client reaches it
            from mlflow.entities import Metric

            self._client.log_batch(run_id, metrics=[Metric(o["key"], o["value"], o["ts"], o["step"]) for o in ops])
            return
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        endpoint = "/api/2.0/mlflow/runs/log-batch"
        body = {"run_id": run_id, "metrics": [{"key": o["key"], "value": _json_double(o["value"]),
                                               "timestamp": o["ts"], "step": o["step"]} for o in ops]}
        verify_rest_response(http_request(self._rest, endpoint, "POST", json=body), endpoint)

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            self._wake.wait(self._every)  # batch whatever arrived meanwhile into few requests
            self._wake.clear()
            self._drain()
            try:
                with self._lock:
                    if self.run_id is None or self._client is None or self._tags:
                        self._connect()
                    self._deliver()
            except Exception as e:  # server down, slow, or refusing: keep the records, retry later
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    warnings.warn(f"MLflow at {self.uri} unreachable ({type(e).__name__}: {str(e)[:200]}); "
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


def _json_double(v: float) -> float | str:
    """A double in proto3's JSON form: NaN and infinities as the strings the server parses (a diverged
    loss must arrive as NaN, not fail the batch as invalid JSON)."""
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def start_tracking(cfg, run_dir: str | os.PathLike, *, rank: int, world_size: int, stage: str,
                   run_id: str | None = None, run_key: str | None = None,
                   params: dict[str, Any] | None = None) -> NullTracker:
    """The tracker for this process: a real one on rank 0 when tracking is enabled.

    A resumed job passes the ``run_id`` (and ``run_key``) its checkpoint recorded to continue that run.
    """
    if rank != 0 or not cfg.tracking.enabled:
        return NullTracker()
    run_dir = Path(run_dir)
    uri = resolve_uri(cfg, run_dir)
    local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    tags = {"stage": stage, "host": socket.gethostname(), "world_size": world_size}
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    # a launcher's shared tags, e.g. every task of a sweep array: {"sweep": "<id>", "sweep_index": 3}
    try:
        tags.update(json.loads(os.environ.get("VITP_MLFLOW_TAGS") or "{}"))
    except json.JSONDecodeError:
        warnings.warn("VITP_MLFLOW_TAGS is not a JSON object; ignored", stacklevel=2)
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
    return Tracker(uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name or run_dir.name,
                   spool_dir=run_dir, run_id=run_id, run_key=run_key, params=params, tags=tags,
                   flush_every_s=cfg.tracking.flush_every_s,
                   artifact_location=(run_dir.resolve() / "mlartifacts").as_uri() if local else None)
