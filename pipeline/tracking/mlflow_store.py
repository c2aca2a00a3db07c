"""The MLflow store side of tracking: the requests that open runs and send records, in order
(:class:`Delivery`), the spool of what could not be sent (``RUN_DIR/mlflow_spool.jsonl``), and the
access check that tells a refusal (login, permission, TLS) from an outage (:func:`access_problem`,
:func:`refusal`). With pipeline/tracking/mlflow_sink.py (the sink's queue and background thread) the
only modules that import mlflow; that module's docstring tells how the two work together.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

from pipeline.errors import Classified
from pipeline.files import append_jsonl, read_jsonl
from pipeline.secrets import has_secret, mask_library_logs, redact, restore

# Fail fast and let our thread retry: mlflow's own retries would stall the queue for minutes.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

SPOOL = "mlflow_spool.jsonl"
_BATCH = 1000  # mlflow's limit of metrics per log_batch
_LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"  # the UI opens on runs, not traces
RUN_KEY_TAG = "vitp_run_key"


class TrackingAccessError(Classified, RuntimeError):
    """The tracking server refused us (login, permission, TLS); the message is one line."""

    exit_code = 2


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


class Delivery:
    """Ops -> MLflow requests, in order, and the spool of what was not delivered. ``_runs`` maps each run
    key met so far to its run id. The sink (pipeline/tracking/mlflow_sink.py) extends it with its queue
    and thread; ``_opened``/``_own_run_id`` are its hooks."""

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
        mask_library_logs()  # a retried request's log line names its query (a token)
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
        ops = read_jsonl(mine, name=self._spool)  # an append a full disk or a crash cut is dropped
        mine.unlink()
        return ops

    def _write_spool(self, header: dict | None) -> int:
        """Append the undelivered ops (run ids filled in where known); returns how many."""
        ops = [dict(op, run_id=op.get("run_id") or self._runs.get(op.get("run_key"))) for op in self._pending]
        if not ops:
            return 0
        append_jsonl(self._spool, ([header] if header else []) + ops)
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



def _json_double(v: float) -> float | str:
    """A double as proto3's JSON writes it: NaN and infinities as strings the server parses (a diverged
    loss arrives as NaN instead of failing the batch as invalid JSON)."""
    if v != v:
        return "NaN"
    return ("Infinity" if v > 0 else "-Infinity") if v in (math.inf, -math.inf) else v
