"""No run stays stranded: a run whose server is gone at its end spools what it could not send and
says `vitp sync RUN_DIR`; `vitp sync` delivers it once the server is back, every record once, and
ends the run with the status it ended in. A process that dies of an exception ends its run FAILED.
A team's experiment kind is kept. Against a real MLflow server (stopped and started for real).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.tracking.mlflow_sink import MlflowSink as Tracker
from pipeline.tracking.mlflow_store import KIND, KIND_TAG, SPOOL

pytestmark = pytest.mark.mlflow_server
ROOT = Path(__file__).resolve().parents[2]


def vitp(*args, env=None, timeout=600):
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_experiment_kind_is_set_once_and_a_teams_kind_is_kept(mlflow_server, tmp_path):
    c = MlflowClient(mlflow_server)
    ours, theirs = f"kind-{uuid.uuid4().hex[:10]}", f"kind-team-{uuid.uuid4().hex[:10]}"
    c.create_experiment(theirs, tags={KIND_TAG: "finetuning"})
    for exp in (ours, theirs):
        t = Tracker(mlflow_server, experiment=exp, run_name="k", spool_dir=tmp_path, flush_every_s=0.2)
        t.close(status="FINISHED")
    assert c.get_experiment_by_name(ours).tags[KIND_TAG] == KIND
    assert c.get_experiment_by_name(theirs).tags[KIND_TAG] == "finetuning"


DIES = """
import sys
from pipeline.tracking.mlflow_sink import MlflowSink as Tracker
t = Tracker(sys.argv[1], experiment=sys.argv[2], run_name="dies", spool_dir=sys.argv[3], flush_every_s=0.2)
t.log({"loss": 1.0}, 1)
print(t.run_id, flush=True)
raise RuntimeError("boom")
"""


def test_a_process_that_dies_of_an_exception_ends_its_run_failed(mlflow_server, tmp_path):
    exp = f"dies-{uuid.uuid4().hex[:10]}"
    r = subprocess.run([sys.executable, "-c", DIES, mlflow_server, exp, str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 1 and "boom" in r.stderr
    run = MlflowClient(mlflow_server).get_run(r.stdout.split()[0])
    assert run.info.status == "FAILED" and run.data.metrics == {"loss": 1.0}


def test_vitp_sync_input_errors_are_one_line(tmp_path):
    r = vitp("sync", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'missing'}: no such run directory"
    r = vitp("sync", str(tmp_path))
    assert r.returncode == 0 and "nothing to sync" in r.stdout


@pytest.mark.slow
def test_stranded_runs_are_finished_by_vitp_sync(mlflow_server, tmp_path):
    """Run B (`vitp pretrain`, 8 steps) loses the server before step 4 and never sees it again; run A
    (a Tracker) never reaches it at all. Both end, spool, and name `vitp sync`; once the server is
    back `vitp sync` delivers every step once and ends both runs FINISHED at the time the job ended;
    a second sync has nothing to do."""
    from pipeline.checkpoint_layout import latest_checkpoint, read_manifest
    from tests.services import mlflow_start, mlflow_stop

    exp, a_dir, b_dir, gate = f"stranded-{uuid.uuid4().hex[:10]}", tmp_path / "a", tmp_path / "b", tmp_path / "gate"
    a_dir.mkdir()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", VITP_TEST_PAUSE_AT_STEP="4",
               VITP_TEST_PAUSE_FILE=str(gate))
    b = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"),
         f"run.dir={b_dir}", "data.path=synthetic:train=64,val=16", "model.img_size=16", "train.steps=8",
         "train.log_every=1", "checkpoint.every=0", f"tracking.uri={mlflow_server}", f"tracking.experiment={exp}",
         "tracking.close_timeout_s=2", "tracking.flush_every_s=0.2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (tmp_path / "gate.4.reached.0").exists():  # B holds before step 4, its run made
            with pytest.raises(subprocess.TimeoutExpired):
                b.wait(timeout=0.1)  # (B must not have ended)
        mlflow_stop()
        (tmp_path / "gate.4").touch()  # steps 4-8 and B's end happen with the server down
        _, err = b.communicate(timeout=600)
        assert b.returncode == 0, err[-3000:]
        assert f"vitp sync {b_dir}" in err
        a = Tracker(mlflow_server, experiment=exp, run_name="a", spool_dir=a_dir, flush_every_s=0.2,
                    params={"optim.lr": 0.1})
        for step in range(1, 41):
            a.log({"loss": 1.0 / step}, step)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a.close(timeout=1.0, status="FINISHED")
        assert any(f"vitp sync {a_dir}" in str(x.message) for x in w)
        assert (a_dir / SPOOL).is_file() and (b_dir / SPOOL).is_file()
    finally:
        if b.poll() is None:
            (tmp_path / "gate.4").touch()
            b.kill()
        back = time.time()
        mlflow_start()
    c = MlflowClient(mlflow_server)
    b_id = read_manifest(latest_checkpoint(b_dir))["mlflow_run_id"]
    assert c.get_run(b_id).info.status == "RUNNING"  # stranded until synced
    assert set(steps(c, b_id, "loss")) <= {1, 2, 3}  # what got out before the server went
    spooled = [json.loads(x) for x in (b_dir / SPOOL).read_text().splitlines()]
    assert {o["step"] for o in spooled if o.get("key") == "loss"} >= set(range(4, 9))
    assert spooled[-1]["op"] == "end" and spooled[-1]["status"] == "FINISHED"
    for d in (a_dir, b_dir):
        r = vitp("sync", str(d))
        assert r.returncode == 0, r.stderr
        assert "(FINISHED)" in r.stdout and not (d / SPOOL).exists()
        again = vitp("sync", str(d))
        assert again.returncode == 0 and "nothing to sync" in again.stdout
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name(exp).experiment_id])}
    assert set(runs) == {"a", "b"} and runs["b"].info.run_id == b_id
    assert steps(c, b_id, "loss") == list(range(1, 9))  # each step once
    assert steps(c, runs["a"].info.run_id, "loss") == list(range(1, 41))
    assert runs["a"].data.params == {"optim.lr": "0.1"}  # made by `vitp sync` from the spool
    for run in runs.values():
        assert run.info.status == "FINISHED"
    # ended when the job ended, not when it was synced
    assert (b_dir / "model.safetensors").stat().st_mtime * 1000 <= runs["b"].info.end_time < back * 1000
    assert {d.dataset.name for d in runs["b"].inputs.dataset_inputs} == {"synthetic/train", "synthetic/val"}


def test_vitp_sync_of_a_cut_spool_delivers_the_rest(mlflow_server, tmp_path):
    """A spool whose appends a full disk cut (a cut line in the middle, a NUL tail at the end): `vitp sync`
    warns once naming the spool and the lines, and delivers every whole record."""
    exp, key, now = f"cut-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex, int(time.time() * 1000)
    ops = [{"op": "run", "run_key": key, "run_id": None, "resume": False, "uri": mlflow_server, "experiment": exp,
            "run_name": "cut", "params": {}}]
    ops += [{"op": "metric", "run_key": key, "key": "loss", "value": 1.0 / s, "ts": now + s, "step": s}
            for s in range(1, 7)]
    ops += [{"op": "end", "run_key": key, "status": "FINISHED", "ts": now + 7}]
    lines = [json.dumps(o) for o in ops]
    lines[3] = lines[3][:40]  # step 3's record, cut; later appends went on after it
    (tmp_path / SPOOL).write_bytes(("\n".join(lines) + "\n").encode() + b"\0" * 500)
    r = vitp("sync", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count(f"{tmp_path / SPOOL}: skipped") == 1 and "lines 4, 9;" in r.stderr, r.stderr
    c = MlflowClient(mlflow_server)
    (run,) = c.search_runs([c.get_experiment_by_name(exp).experiment_id])
    assert steps(c, run.info.run_id, "loss") == [1, 2, 4, 5, 6] and run.info.status == "FINISHED"
    assert not (tmp_path / SPOOL).exists()
