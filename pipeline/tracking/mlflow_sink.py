"""The MLflow sink: tracking that never slows or stops training; the only module that imports mlflow.

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
import getpass
import json
import math
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.secrets import has_secret, redact, restore
from pipeline.tracking.sink import Sink

# Fail fast and let our thread retry: mlflow's own retries would stall the queue for minutes.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

SPOOL = "mlflow_spool.jsonl"
_BATCH = 1000  # mlflow's limit of metrics per log_batch
_LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"  # the UI opens on runs, not traces
RUN_KEY_TAG = "vitp_run_key"


class TrackingAccessError(RuntimeError):
    """The tracking server refused us (login, permission, TLS); the message is one line."""


def _status(e: BaseException) -> int | None:
    from mlflow.exceptions import MlflowException

    return e.get_http_status_code() if isinstance(e, MlflowException) else None


def _tls_failure(e: BaseException) -> BaseException | None:
    """The SSL error behind ``e`` (mlflow wraps requests' errors into its own, as their context)."""
    import ssl

    import requests

    seen = e
    while seen is not None:
        if isinstance(seen, (ssl.SSLError, requests.exceptions.SSLError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def refusal(e: BaseException, uri: str, experiment: str | None = None) -> str | None:
    """One line saying why the server at ``uri`` refused us and what to set; None for an outage
    (connection failure, timeout, 5xx, 429) or any other error worth retrying."""
    where = f"MLflow at {redact(uri)}"
    status = _status(e)
    if status == 401:
        if "@" in uri.partition("://")[2].partition("/")[0]:
            what = "the server refused the credentials in the URI; set MLFLOW_TRACKING_USERNAME/PASSWORD instead"
        elif os.environ.get("MLFLOW_TRACKING_USERNAME") or os.environ.get("MLFLOW_TRACKING_TOKEN"):
            what = "the server refused the credentials in MLFLOW_TRACKING_USERNAME/PASSWORD (or _TOKEN): fix them"
        else:
            what = "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
        return f"{where} refused the login (HTTP 401); {what}"
    if status == 403:
        exp = f" on experiment {experiment!r}" if experiment else ""
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        return (f"{where}: permission denied{exp}" + (f" for user {user!r}" if user else "") +
                " (HTTP 403); ask the experiment's owner for EDIT, or set tracking.experiment to one you may write")
    tls = _tls_failure(e)
    if tls is not None:
        return (f"{where}: TLS verification failed ({redact(str(tls))[:160]}); set MLFLOW_TRACKING_SERVER_CERT_PATH "
                "to the server's CA bundle (or MLFLOW_TRACKING_CLIENT_CERT_PATH for a client certificate)")
    return None


def access_problem(uri: str, experiment: str) -> str | None:
    """Can the credentials this process holds write to ``experiment`` at ``uri``? Creates it, or reads it
    and writes its kind tag (a write that changes nothing a team set): None when yes, else one line
    (server, reason, what to set). A server that is only unreachable is not a problem here: an outage
    is buffered and spooled. Local stores (sqlite:, file:, a path) need no login."""
    uri = restore(uri)
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    c = MlflowClient(uri)
    try:
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            c.create_experiment(experiment, tags={KIND_TAG: KIND})
        else:
            c.set_experiment_tag(exp.experiment_id, KIND_TAG, exp.tags.get(KIND_TAG, KIND))
    except MlflowException as e:
        return refusal(e, uri, experiment)
    return None


def source_tags(stage: str) -> dict[str, str]:
    """MLflow's standard source tags: what ran (``vitp STAGE``), which code, who, how started."""
    from mlflow.utils.git_utils import get_git_branch, get_git_commit, get_git_repo_url

    here = str(Path(__file__).resolve().parent)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (some containers)
        user = os.environ.get("USER", "unknown")
    tags = {"mlflow.source.name": f"vitp {stage}", "mlflow.user": user,
            "mlflow.source.type": "JOB" if os.environ.get("SLURM_JOB_ID") else "LOCAL",
            "mlflow.source.git.commit": get_git_commit(here), "mlflow.source.git.branch": get_git_branch(here),
            "mlflow.source.git.repoURL": get_git_repo_url(here)}
    return {k: v for k, v in tags.items() if v}


class _Delivery:
    """Ops -> MLflow requests, in order. ``_runs`` maps each run key met so far to its run id."""

    def __init__(self, uri: str, spool_dir: str | os.PathLike):
        self._set_uri(uri)
        self._spool = Path(spool_dir) / SPOOL
        self._pending: list[dict] = []
        self._delivered = 0  # ops sent so far, counted as they go (flush waits on it)
        self._runs: dict[str, str] = {}
        self._client = None
        self._rest = False  # a server: metric batches go to its REST API directly
        self._lock = threading.Lock()  # one mlflow request at a time (thread, log_model, close)

    def _set_uri(self, uri: str) -> None:
        self._uri = restore(uri)  # what we connect with; in memory only
        self.uri = redact(uri)  # what we write and show
        if has_secret(self._uri):  # MLflow prints "View run ... at: <the URI>" when a run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"

    def _claim_spool(self) -> list[dict]:
        """Take the spool (a rename: of two claimers, one gets it) and return its ops."""
        if not self._spool.is_file():
            return []
        mine = self._spool.with_name(f".{SPOOL}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self._spool, mine)
        except FileNotFoundError:
            return []
        ops = [json.loads(line) for line in mine.read_text().splitlines() if line.strip()]
        mine.unlink()
        return ops

    def _write_spool(self, header: dict | None) -> int:
        """Append the undelivered ops (run ids filled in where known); returns how many."""
        ops = [dict(op, run_id=op.get("run_id") or self._runs.get(op.get("run_key"))) for op in self._pending]
        if not ops:
            return 0
        with open(self._spool, "a") as f:
            for op in ([header] if header else []) + ops:
                f.write(json.dumps(op) + "\n")
        self._pending = []
        return len(ops)

    def _connect(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self._uri)
            self._rest = self._uri.startswith(("http://", "https://"))
        return self._client

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        c = self._client
        exp = c.get_experiment_by_name(name)
        if exp is None:
            return c.create_experiment(name, artifact_location=artifact_location, tags={KIND_TAG: KIND})
        if KIND_TAG not in exp.tags:  # a kind the team set stays
            c.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
        return exp.experiment_id

    def _open_run(self, op: dict) -> str:
        """A ``run`` op: continue ``run_id``, or find the run by its key, or create it."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        c, key, tags = self._client, op["run_key"], dict(op.get("tags") or {})
        if op.get("run_id"):
            rid = op["run_id"]
            if op.get("resume"):  # a new job continues the run: it runs again, with this job's tags
                c.update_run(rid, status="RUNNING")
                if tags:
                    c.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()])
            return rid
        exp_id, parent = None, op.get("parent_run_id")
        if parent:
            try:
                exp_id = c.get_run(parent).info.experiment_id
                tags["mlflow.parentRunId"] = parent
                if KIND_TAG not in c.get_experiment(exp_id).tags:
                    c.set_experiment_tag(exp_id, KIND_TAG, KIND)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warnings.warn(f"MLflow run {parent} not found at {self.uri}; logging a top-level run", stacklevel=1)
        exp_id = exp_id or self._experiment(op["experiment"], op.get("artifact_location"))
        found = c.search_runs([exp_id], filter_string=f"tags.{RUN_KEY_TAG} = '{key}'", max_results=1)
        if found:
            return found[0].info.run_id
        run = c.create_run(exp_id, run_name=op.get("run_name"), tags={**tags, RUN_KEY_TAG: key})
        params = [Param(k, v) for k, v in (op.get("params") or {}).items()]
        for i in range(0, len(params), 100):
            c.log_batch(run.info.run_id, params=params[i:i + 100])
        return run.info.run_id

    def _deliver(self, limit: int | None = None) -> None:
        """Send pending ops in order until none (or ``limit``) are left; raises when the server fails."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, RunTag

        c, sent = self._connect(), 0
        while self._pending and (limit is None or sent < limit):
            op, n = self._pending[0], 1
            if op["op"] == "run":
                self._runs[op["run_key"]] = self._open_run(op)
                self._opened(op)
            rid = op.get("run_id") or self._runs.get(op.get("run_key")) or self._own_run_id()
            if op["op"] == "metric":
                n = 0
                while (n < min(len(self._pending), _BATCH) and self._pending[n]["op"] == "metric"
                       and self._pending[n].get("run_key") == op.get("run_key")
                       and self._pending[n].get("run_id") == op.get("run_id")):
                    n += 1
                self._log_metrics(rid, self._pending[:n])
            elif op["op"] == "artifact":
                if Path(op["path"]).exists():
                    c.log_artifact(rid, op["path"], op.get("artifact_path"))
            elif op["op"] == "table":
                self._send_table(rid, op)
            elif op["op"] == "inputs":
                c.log_inputs(rid, datasets=[DatasetInput(
                    Dataset(d["name"], d["digest"], d["source_type"], d["source"], d.get("schema"), d.get("profile")),
                    [InputTag("mlflow.data.context", d["context"])]) for d in op["datasets"]])
            elif op["op"] == "end":
                c.set_terminated(rid, op["status"], end_time=op.get("ts"))
            elif op["op"] == "tags":
                c.log_batch(rid, tags=[RunTag(k, v) for k, v in op["tags"].items()])
            del self._pending[:n]
            sent += n
            self._delivered += n

    def _log_metrics(self, rid: str, ops: list[dict]) -> None:
        """One log-batch request. To a server the JSON is built here and posted with mlflow's own
        http_request (its auth, TLS, retry and timeout settings): MlflowClient.log_batch first builds and
        validates an entity and a protobuf message per metric, which at log_every=1 was most of what
        tracking cost the trainer's CPU (bench/tracking.py). Local stores go through the client."""
        if not self._rest:
            from mlflow.entities import Metric

            self._client.log_batch(rid, metrics=[Metric(o["key"], o["value"], o["ts"], o["step"]) for o in ops])
            return
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        # read per request, as MLflow's RestStore does: its auth (basic, bearer) and TLS settings
        # (server CA, insecure, client certificate) from MLFLOW_TRACKING_* and ~/.mlflow/credentials
        creds = get_default_host_creds(self._uri)
        body = {"run_id": rid, "metrics": [{"key": o["key"], "value": _json_double(o["value"]), "timestamp": o["ts"],
                                            "step": o["step"]} for o in ops]}
        verify_rest_response(http_request(creds, _LOG_BATCH, "POST", json=body), _LOG_BATCH)

    def _send_table(self, rid: str, op: dict) -> None:
        """A table in MLflow's own format (what ``log_table`` writes, so the UI shows it as a table),
        uploaded whole: a re-send overwrites it rather than appending rows."""
        rows = op["rows"]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / Path(op["artifact_file"]).name
            path.write_text(json.dumps({"columns": columns, "data": [[r.get(k) for k in columns] for r in rows]}))
            folder = str(Path(op["artifact_file"]).parent)
            self._client.log_artifact(rid, str(path), None if folder == "." else folder)
        tag = "mlflow.loggedArtifacts"
        logged = json.loads(self._client.get_run(rid).data.tags.get(tag, "[]"))
        if not any(a.get("path") == op["artifact_file"] for a in logged):
            self._client.set_tag(rid, tag, json.dumps([*logged, {"path": op["artifact_file"], "type": "table"}]))

    def deliver_spool(self, uri: str | None, timeout: float) -> dict:
        """Deliver this spool dir's ``mlflow_spool.jsonl`` (what :meth:`MlflowSink.sync` does, see there)."""
        from mlflow.exceptions import RestException

        self._pending = ops = self._claim_spool()
        self._set_uri(uri or next((o["uri"] for o in reversed(ops) if o["op"] == "run" and o.get("uri")), ""))
        if ops and not self.uri:
            self._write_spool(None)
            raise ValueError(f"{self._spool}: names no tracking server; pass --uri")
        deadline, err = time.monotonic() + timeout, None
        while self._pending and time.monotonic() < deadline:
            try:
                self._deliver()
            except Exception as e:
                err = e
                if isinstance(e, RestException) or refusal(e, self._uri):  # a no: retrying would not change its mind
                    break
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))  # unreachable: keep trying
        key = self._pending[0].get("run_key") if self._pending else None  # the header names the run it continues
        left = self._write_spool(None if not self._pending or self._pending[0]["op"] == "run" else
                                 {"op": "run", "run_key": key, "run_id": self._runs.get(key), "uri": self.uri})
        runs = {rid: self._client.get_run(rid).info.status for rid in set(self._runs.values())} if not left else {}
        return {"delivered": self._delivered, "left": left, "runs": runs, "uri": self.uri,
                "error": (refusal(err, self._uri) or redact(f"{type(err).__name__}: {str(err)[:200]}"))
                if left and err else None}

    def _opened(self, op: dict) -> None: ...

    def _own_run_id(self) -> str | None:
        return None


class MlflowSink(_Delivery, Sink):
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
        return _Delivery(uri or "", run_dir).deliver_spool(uri, timeout)

    @staticmethod
    def spooled(run_dir: str | os.PathLike) -> int:
        """How many records (metrics, tags, artifacts, run ends) wait in ``RUN_DIR/mlflow_spool.jsonl``."""
        p = Path(run_dir) / SPOOL
        try:
            lines = p.read_text().splitlines()
        except OSError:
            return 0
        return sum(1 for line in lines if line.strip() and json.loads(line).get("op") != "run")

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
            try:
                with self._lock:
                    self._deliver()
            except Exception as e:  # server down or slow: keep the records, retry later
                if self._refused or self._refuse(e):
                    return  # close() spools what is pending; flush sees this thread gone
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


def _json_double(v: float) -> float | str:
    """A double as proto3's JSON writes it: NaN and infinities as strings the server parses (a diverged
    loss arrives as NaN instead of failing the batch as invalid JSON)."""
    if v != v:
        return "NaN"
    return ("Infinity" if v > 0 else "-Infinity") if v in (math.inf, -math.inf) else v
