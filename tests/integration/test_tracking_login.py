"""A login-protected MLflow server, as teams run it: MLflow's basic-auth app behind nginx with TLS (a CA
made here), all on loopback (tests/auth_services.py).

- Credentials by environment: metrics arrive over HTTPS, the certificate verified with the test's CA.
- No credentials, a wrong password, a missing permission, an untrusted certificate: `vitp submit` and a
  stage's start refuse in one line naming the server, the reason and what to set; nothing is queued or
  trained.
- A password changed mid-run: reported once, loudly; the records spool; `vitp submit --wait`'s last line
  and `vitp jobs` say so; `vitp sync` delivers them with fresh credentials.
- Secrets planted in `tracking.uri` (a password in its userinfo, a token in its query) appear in no file
  the run or its job wrote, and in no MLflow param or tag.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.auth_services import auth_stack

pytestmark = pytest.mark.mlflow_server
ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/pretrain/tiny_cpu.yaml"
SMALL = ["data.path=synthetic:train=64,val=16", "model.img_size=16", "model.depth=1", "train.log_every=1",
         "cluster.tasks_per_node=1", "tracking.flush_every_s=0.2", "tracking.close_timeout_s=5",
         "tracking.system_metrics=false"]
_MLFLOW_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_INSECURE_TLS", "VITP_SECRETS")


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    yield from auth_stack(tmp_path_factory.mktemp("auth"))


@pytest.fixture
def clean_env(monkeypatch):
    for k in _MLFLOW_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def env_with(**kv) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in _MLFLOW_VARS}
    return {**e, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **kv}


def vitp(*args, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def user(auth) -> tuple[str, str]:
    name, pw = f"u{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex[:16]}"
    auth.create_user(name, pw)
    return name, pw


def test_metrics_arrive_over_https_with_credentials_from_the_environment(auth, clean_env, tmp_path):
    from mlflow import MlflowClient

    from pipeline.tracking.mlflow_sink import MlflowSink as Tracker

    name, pw = user(auth)
    for k, v in {"MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": pw,
                 "MLFLOW_TRACKING_SERVER_CERT_PATH": str(auth.ca)}.items():
        clean_env.setenv(k, v)
    exp = f"https-{uuid.uuid4().hex[:8]}"
    t = Tracker(auth.https, experiment=exp, run_name="r", spool_dir=tmp_path, flush_every_s=0.2, params={"a": 1})
    for step in range(1, 31):  # batches through vitp's own REST posting, over TLS, with basic auth
        t.log({"loss": 1.0 / step}, step)
    t.close(timeout=60, status="FINISHED")
    assert not (tmp_path / "mlflow_spool.jsonl").exists()
    run = MlflowClient(auth.https).get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"a": "1"}
    assert [m.step for m in MlflowClient(auth.https).get_metric_history(t.run_id, "loss")] == list(range(1, 31))


def test_a_refused_login_is_one_line_before_anything_is_queued_or_trained(auth, tmp_path):
    name, pw = user(auth)
    base = ["--config", TINY, *SMALL, "train.steps=2", f"tracking.uri={auth.https}"]
    ca = {"MLFLOW_TRACKING_SERVER_CERT_PATH": str(auth.ca)}
    cases = {  # environment -> what the one line must say
        "none": (ca, "refused the login (HTTP 401); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
        "wrong": ({**ca, "MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": "not-" + pw},
                  "refused the login (HTTP 401); the server refused the credentials in MLFLOW_TRACKING_USERNAME"),
        "untrusted": ({"MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": pw},
                      "TLS verification failed"),
    }
    for case, (env, says) in cases.items():
        jobs, run = tmp_path / case / "jobs", tmp_path / case / "run"
        r = vitp("submit", "pretrain", "--cluster", "local", *base, f"run.dir={run}", f"cluster.log_dir={jobs}",
                 "tracking.experiment=login", env=env_with(**env))
        assert r.returncode == 2, (case, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: MLflow at {auth.https}"), (case, r.stderr)
        assert says in r.stderr, (case, r.stderr)
        assert not jobs.exists() and not run.exists()  # nothing queued
    # a stage started by hand (or by a launcher) checks at its start: nothing trains for nothing
    run = tmp_path / "stage" / "run"
    r = vitp("pretrain", *base, f"run.dir={run}", "tracking.experiment=login", env=env_with(**ca))
    assert r.returncode == 2 and "refused the login (HTTP 401)" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    # a permission the user lacks: the admin's experiment is READ for others
    locked = f"locked-{uuid.uuid4().hex[:6]}"
    admin = env_with(**ca, **auth.admin_env())
    assert vitp("submit", "pretrain", "--dry-run", *base, f"tracking.experiment={locked}", env=admin).returncode == 0
    r = vitp("submit", "pretrain", "--cluster", "local", *base, f"run.dir={tmp_path / 'p'}",
             f"cluster.log_dir={tmp_path / 'p' / 'jobs'}", f"tracking.experiment={locked}",
             env=env_with(**ca, MLFLOW_TRACKING_USERNAME=name, MLFLOW_TRACKING_PASSWORD=pw))
    assert r.returncode == 2 and f"permission denied on experiment {locked!r} for user {name!r} (HTTP 403)" in r.stderr
    assert not (tmp_path / "p").exists()


def _files_holding(roots: list[Path], needles: list[bytes]) -> list[str]:
    hits = []
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and any(n in p.read_bytes() for n in needles):
                hits.append(str(p))
    return hits


@pytest.mark.slow
def test_a_password_changed_mid_run_spools_and_sync_delivers_and_no_secret_is_written(auth, clean_env, tmp_path):
    """`vitp submit --wait` (local executor) logs in with the password and the gateway token planted in
    tracking.uri. At step 4 the password changes: the job reports it once, keeps training, spools;
    the last line and `vitp jobs` name `vitp sync`; with the new password `vitp sync` delivers every step."""
    from mlflow import MlflowClient

    name, pw = user(auth)
    host = auth.https.removeprefix("https://")
    uri = f"https://{name}:{pw}@{host}/gw?token={auth.token}"
    shown = f"https://***@{host}/gw?token=***"
    run, jobs, gate, exp = tmp_path / "run", tmp_path / "jobs", tmp_path / "gate", f"revoked-{uuid.uuid4().hex[:6]}"
    env = env_with(MLFLOW_TRACKING_SERVER_CERT_PATH=str(auth.ca), VITP_TEST_PAUSE_AT_STEP="4",
                   VITP_TEST_PAUSE_FILE=str(gate))
    p = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "submit", "pretrain", "--cluster", "local", "--config", TINY, *SMALL,
         "train.steps=8", "checkpoint.every=4", f"run.dir={run}", f"cluster.log_dir={jobs}", f"tracking.uri={uri}",
         f"tracking.experiment={exp}", "--wait"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        while not Path(f"{gate}.4.reached.0").exists():  # the job holds before step 4, its run made
            with pytest.raises(subprocess.TimeoutExpired):
                p.wait(timeout=0.2)
        new_pw = f"pw-{uuid.uuid4().hex[:16]}"
        auth.set_password(name, new_pw)  # what an expired token looks like to the job: 401 from now on
        Path(f"{gate}.4").touch()
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            Path(f"{gate}.4").touch()
            p.kill()
    assert p.returncode == 0, err[-3000:]
    job_id = out.split()[1]
    lines = out.strip().splitlines()
    n_line = lines[-1]
    assert n_line.startswith(f"job {job_id} tracking: ") and "records spooled in" in n_line, out
    assert n_line.endswith(f"deliver them with `vitp sync {run}`"), out
    log = (jobs / job_id / f"{job_id}_0_log.err").read_text()
    assert log.count(f"ERROR: MLflow at {shown} refused the login (HTTP 401)") == 1, log[-3000:]
    listing = vitp("jobs", "--log-dir", str(jobs), env=env_with()).stdout
    assert "COMPLETED" in listing and f"`vitp sync {run}`" in listing, listing

    secrets = [pw.encode(), auth.token.encode()]
    assert _files_holding([run, jobs], secrets) == []  # config.yaml, manifests, spool, pickles, logs, results
    assert shown in (run / "config.yaml").read_text()

    # the old password is refused by sync too (one request, no retries), and the spool stays
    stale = vitp("sync", str(run), "--uri", f"{auth.https}/gw?token={auth.token}",
                 env=env_with(MLFLOW_TRACKING_SERVER_CERT_PATH=str(auth.ca), MLFLOW_TRACKING_USERNAME=name,
                              MLFLOW_TRACKING_PASSWORD=pw), timeout=120)
    assert stale.returncode == 1 and "refused the login (HTTP 401)" in stale.stderr, stale.stderr
    fresh = vitp("sync", str(run), "--uri", f"{auth.https}/gw?token={auth.token}",
                 env=env_with(MLFLOW_TRACKING_SERVER_CERT_PATH=str(auth.ca), MLFLOW_TRACKING_USERNAME=name,
                              MLFLOW_TRACKING_PASSWORD=new_pw), timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    assert auth.token not in fresh.stdout + fresh.stderr and new_pw not in fresh.stdout + fresh.stderr
    assert "tracking: delivered" in vitp("jobs", "--log-dir", str(jobs), env=env_with()).stdout

    for k, v in {**auth.admin_env(), "MLFLOW_TRACKING_SERVER_CERT_PATH": str(auth.ca)}.items():
        clean_env.setenv(k, v)
    c = MlflowClient(auth.https)
    (r,) = c.search_runs([c.get_experiment_by_name(exp).experiment_id])
    assert r.info.status == "FINISHED"
    assert sorted(m.step for m in c.get_metric_history(r.info.run_id, "loss")) == list(range(1, 9))
    assert r.data.params["tracking.uri"] == shown
    written = [*r.data.params.values(), *r.data.tags.values()]
    assert not [v for v in written if pw in v or auth.token in v]
