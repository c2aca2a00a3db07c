"""The asynchronous MLflow tracker: batching, continuing a run, outages (spool), rank-0 only."""

import gc
import json
import time
import warnings

import pytest
from mlflow import MlflowClient

from pipeline.eval.figures import loss_curve_png
from pipeline.network import free_port
from pipeline.tracking import Sink
from pipeline.tracking.mlflow_sink import SPOOL
from pipeline.tracking.mlflow_sink import MlflowSink as Tracker
from pipeline.tracking.setup import Tracking


def dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a port nobody listens on


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{d / 'mlflow.db'}", d


def test_metrics_params_and_continued_run(store, tmp_path):
    uri, d = store
    t = Tracker(uri, experiment="unit", run_name="r", spool_dir=tmp_path, params={"optim.lr": 0.001},
                tags={"stage": "pretrain"}, flush_every_s=0.2, artifact_location=(d / "art").as_uri())
    for step in range(1, 51):
        t.log({"loss": 1.0 / step, "lr": 0.1}, step)
    assert t.flush(30)
    run_id = t.run_id
    t.close()
    again = Tracker(uri, experiment="unit", run_name="r", spool_dir=tmp_path, run_id=run_id,
                    params={"optim.lr": 0.5}, flush_every_s=0.2)
    again.log({"loss": 0.001}, 51)
    again.close()
    c = MlflowClient(uri)
    hist = c.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(1, 52))
    run = c.get_run(run_id)
    assert run.data.params == {"optim.lr": "0.001"}  # not re-logged on continue
    assert run.data.tags["stage"] == "pretrain"


def test_run_creation_is_idempotent_by_key(store, tmp_path):
    """A retry after a create_run whose reply was lost finds the run instead of making a second."""
    uri, d = store
    a = Tracker(uri, experiment="unit-key", run_name="k", spool_dir=tmp_path, flush_every_s=0.2,
                artifact_location=(d / "art").as_uri())
    a.close()
    b = Tracker(uri, experiment="unit-key", run_name="k", spool_dir=tmp_path, run_key=a.run_key,
                flush_every_s=0.2)
    b.close()
    assert b.run_id == a.run_id
    c = MlflowClient(uri)
    assert len(c.search_runs([c.get_experiment_by_name("unit-key").experiment_id])) == 1


def test_outage_buffers_spools_and_a_later_tracker_delivers(store, tmp_path):
    uri, d = store
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = Tracker(dead_uri(), experiment="unit-outage", run_name="o", spool_dir=tmp_path, flush_every_s=0.2)
        gc.collect()  # late in a long session, a collection of its whole heap is not the server's wait
        gc.disable()
        try:
            t0 = time.perf_counter()
            for step in range(1, 1001):
                t.log({"loss": float(step)}, step)
            assert time.perf_counter() - t0 < 0.5  # logging never waits for the server
        finally:
            gc.enable()
        t.close(timeout=1.0)
    assert any("unreachable" in str(x.message) for x in w)
    ops = [json.loads(line) for line in (tmp_path / SPOOL).read_text().splitlines()]
    assert ops[0]["op"] == "run" and ops[0]["run_id"] is None  # what `vitp sync` needs to create the run
    assert [o["step"] for o in ops[1:] if o["op"] == "metric"] == list(range(1, 1001))
    # the job that resumes this run dir (its checkpoint recorded the run key) delivers them into the run
    t2 = Tracker(uri, experiment="unit-outage", run_name="o", spool_dir=tmp_path, flush_every_s=0.2,
                 run_key=t.run_key, artifact_location=(d / "art").as_uri())
    assert t2.flush(30)
    t2.close()
    assert not (tmp_path / SPOOL).exists()
    c = MlflowClient(uri)
    assert len(c.search_runs([c.get_experiment_by_name("unit-outage").experiment_id])) == 1
    hist = c.get_metric_history(t2.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(1, 1001))


def test_only_rank0_tracks(tmp_path):
    from pipeline.config import load_config

    cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic"], world_size=2)
    assert type(Tracking.from_config(cfg, tmp_path, rank=1).mlflow(world_size=2, stage="pretrain")) is Sink
    cfg.tracking.enabled = False
    assert type(Tracking.from_config(cfg, tmp_path, rank=0).mlflow(world_size=2, stage="pretrain")) is Sink


def test_loss_curve_png(tmp_path):
    out = loss_curve_png([{"step": s, "loss": 1.0 / s} for s in range(1, 10)], tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert loss_curve_png([{"step": 1}], tmp_path / "none.png") is None
