"""The MLflow tracking server is real: what a run logs comes back exactly, and survives a restart.

Fixture `mlflow_server` comes from tests/services.py via tests/conftest.py.
"""

from __future__ import annotations

import uuid

import mlflow.tracking as mlflow_tracking  # a required package: a broken install fails here, never skips
import pytest

from tests.services import mlflow_start, mlflow_stop

PARAMS = {"model": "vit_tiny_patch16", "lr": "0.0003", "global_batch": "64"}
# (step, loss): 1/3 checks that a value with no short decimal form round-trips bit for bit.
LOSS = [(0, 2.5), (10, 1.25), (20, 1 / 3)]
ARTIFACT = "patch: 16\nimage: 32\n"


def _log_run(client, tmp_path) -> str:
    exp_id = client.create_experiment(f"vitp-test-{uuid.uuid4().hex[:12]}")
    run_id = client.create_run(exp_id).info.run_id
    for key, value in PARAMS.items():
        client.log_param(run_id, key, value)
    for step, value in LOSS:
        client.log_metric(run_id, "train/loss", value, step=step)
    cfg = tmp_path / "resolved.yaml"
    cfg.write_text(ARTIFACT)
    client.log_artifact(run_id, str(cfg), artifact_path="config")
    client.set_terminated(run_id)
    return run_id


def _assert_run(client, run_id, tmp_path) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == PARAMS
    assert run.data.metrics == {"train/loss": LOSS[-1][1]}
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert history == LOSS
    assert [a.path for a in client.list_artifacts(run_id, "config")] == ["config/resolved.yaml"]
    local = client.download_artifacts(run_id, "config/resolved.yaml", str(tmp_path / "dl"))
    with open(local) as f:
        assert f.read() == ARTIFACT


@pytest.mark.mlflow_server
def test_run_round_trips_through_server(mlflow_server, tmp_path):
    client = mlflow_tracking.MlflowClient(tracking_uri=mlflow_server)
    run_id = _log_run(client, tmp_path)
    _assert_run(client, run_id, tmp_path)


@pytest.mark.mlflow_server
@pytest.mark.slow
def test_run_survives_server_restart(mlflow_server, tmp_path, monkeypatch):
    # The client retries a dead server with backoff for minutes by default; one quick try proves "down".
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    client = mlflow_tracking.MlflowClient(tracking_uri=mlflow_server)
    run_id = _log_run(client, tmp_path)
    mlflow_stop()
    try:
        with pytest.raises(Exception):  # noqa: B017 - any connection error proves it is down
            mlflow_tracking.MlflowClient(tracking_uri=mlflow_server).get_run(run_id)
    finally:
        uri = mlflow_start()
    assert uri == mlflow_server
    _assert_run(mlflow_tracking.MlflowClient(tracking_uri=uri), run_id, tmp_path)


@pytest.mark.mlflow_server
def test_tracker_posts_metrics_that_the_server_stores_as_log_batch_does(mlflow_server, tmp_path):
    """To a server, the Tracker posts metric batches to the REST API itself, not through MlflowClient:
    the server must store what the client's log_batch stores (1/3 bit for bit, NaN, both infinities)."""
    from mlflow.entities import Metric

    from pipeline.tracking.mlflow_sink import MlflowSink as Tracker

    exp = f"vitp-test-{uuid.uuid4().hex[:12]}"
    values = [1 / 3, float("nan"), float("inf"), float("-inf"), 2.5]
    t = Tracker(mlflow_server, experiment=exp, run_name="rest", spool_dir=tmp_path, flush_every_s=0.2)
    for step, v in enumerate(values):
        t.log({"loss": v}, step)
    assert t.flush(30)
    assert t._rest is not None  # the REST path is the one that delivered them
    t.close()
    client = mlflow_tracking.MlflowClient(tracking_uri=mlflow_server)
    ref = client.create_run(client.get_experiment_by_name(exp).experiment_id).info.run_id
    client.log_batch(ref, metrics=[Metric("loss", v, 0, step) for step, v in enumerate(values)])

    def stored(run_id):
        return sorted((m.step, repr(m.value)) for m in client.get_metric_history(run_id, "loss"))

    got = stored(t.run_id)
    assert got == stored(ref)  # infinities included: the store clamps them, the same for both paths
    assert [s for s, _ in got] == list(range(len(values))) and got[0][1] == repr(1 / 3) and got[1][1] == "nan"
