"""`vitp submit` on the real local SLURM cluster (2 nodes x 1 task, CPU, gloo).

The launch machinery (rendezvous, USR2 → collective save → requeue → resume) is tested with the stub
stage in test_submit_stub.py and, once it exists, with the real pre-training stage.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.jobs import read_index, slurm_states
from launch.submit import submit_main

ROOT = Path(__file__).resolve().parents[2]
STUB = "tests.e2e.test_submit_stub:train"
TINY = "configs/pretrain/tiny_cpu.yaml"
RES = "configs/cluster/local_debug.yaml"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def cluster(request):
    """The local cluster (tests/services.py's fixture when present); skip only when not root outside CI."""
    try:
        return request.getfixturevalue("slurm_cluster")
    except pytest.FixtureLookupError:
        pass
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("SLURM tests need root (the local cluster runs as root); CI runs them")
    if shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True).returncode:
        if os.environ.get("CI") or os.environ.get("VITP_SLURM"):
            pytest.fail("SLURM cluster not reachable; start it with launch/services/slurm.sh up")
        pytest.skip("no SLURM cluster (launch/services/slurm.sh up)")
    return True


def poll(pred, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def fake_data(path: Path, shards: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    files = [f"train-{i:06d}.tar" for i in range(shards)]
    (path / "_info.json").write_text(json.dumps({"splits": {"train": {"filenames": files}}}))
    return path


def metrics(run: Path) -> list[dict]:
    m = run / "metrics.jsonl"
    return [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else []


def last_step(run: Path) -> int:
    rows = metrics(run)
    return rows[-1]["step"] if rows else 0


def submit(argv, capsys, target=STUB) -> tuple[int, str]:
    rc = submit_main(argv, target=target)
    out = capsys.readouterr().out
    return rc, out


def n_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def preempt_at(run: Path, jid: str, k: int, events: Path, nth: int) -> None:
    """USR2 once the run has logged step k; wait until the job has requeued itself for the nth time."""
    poll(lambda: last_step(run) >= k, 300, f"step {k}")
    subprocess.run(["scancel", "--signal=USR2", jid], check=True)
    poll(lambda: n_lines(events) >= nth, 180, f"requeue #{nth}")


def job_id(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("job "))


def test_stub_two_nodes_completes(cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = fake_data(tmp_path / "data")
    rc, out = submit(["pretrain", "--config", TINY, "--resources", RES, f"data.path={data}", "train.steps=4",
                      f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"], capsys)
    assert rc == 0, out
    jid = job_id(out)
    res = json.loads((tmp_path / "jobs" / jid / "result.json").read_text())
    assert (res["status"], res["step"], res["world_size"]) == ("completed", 4, 2)
    assert [e["job_id"] for e in read_index(tmp_path / "jobs")] == [jid]
    assert (tmp_path / "jobs" / jid / "config.yaml").is_file()


def test_preempt_twice_resumes_exactly(cluster, tmp_path, capsys, monkeypatch):
    """USR2 at two random steps: the job saves on both ranks, requeues itself, resumes, and ends with
    the loss sequence and weights of an uninterrupted run; each step logged once."""
    monkeypatch.chdir(ROOT)
    data = fake_data(tmp_path / "data")
    steps = 40
    common = ["pretrain", "--config", TINY, "--resources", RES, f"data.path={data}", f"train.steps={steps}",
              f"cluster.log_dir={tmp_path / 'jobs'}"]
    rc, out = submit([*common, f"run.dir={tmp_path / 'ref'}"], capsys)
    ref_job = job_id(out)
    rc, out = submit([*common, f"run.dir={tmp_path / 'pre'}"], capsys)
    assert rc == 0
    jid = job_id(out)
    run = tmp_path / "pre"
    rng = random.Random(0)
    events = tmp_path / "jobs" / jid / "events.jsonl"
    for i, k in enumerate((rng.randint(3, 10), rng.randint(18, 26))):
        preempt_at(run, jid, k, events, i + 1)
    entries = [e for e in read_index(tmp_path / "jobs")]
    from launch.jobs import outcome, wait

    states = wait(entries, timeout_s=600)
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        assert ok, line
    events = [json.loads(x) for x in (tmp_path / "jobs" / jid / "events.jsonl").read_text().splitlines()]
    assert [e["restart"] for e in events] == [0, 1]
    res = json.loads((tmp_path / "jobs" / jid / "result.json").read_text())
    assert (res["status"], res["restarts"]) == ("completed", 2)
    got, ref = metrics(run), metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert got == ref
    assert (run / "model.json").read_text() == (tmp_path / "ref" / "model.json").read_text()
    assert ref_job != jid


def test_bad_submissions_fail_before_sbatch(cluster, tmp_path, monkeypatch):
    """Unknown partition, nodes=0, missing data: one line, exit 2, sbatch never called."""
    monkeypatch.chdir(ROOT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "sbatch-called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    data = fake_data(tmp_path / "data")
    base = [sys.executable, "-m", "launch.cli", "submit", "pretrain", "--config", TINY, "--resources", RES,
            f"cluster.log_dir={tmp_path / 'jobs'}"]
    cases = {
        "cluster.partition: unknown partition 'nope'": [f"data.path={data}", "cluster.partition=nope"],
        "cluster.nodes: must be >= 1; got 0": [f"data.path={data}", "cluster.nodes=0"],
        "_info.json not found": [f"data.path={tmp_path / 'missing'}"],
        "shards < world size 2": [f"data.path={fake_data(tmp_path / 'one', shards=1)}"],
    }
    for expect, extra in cases.items():
        t0 = time.monotonic()
        r = subprocess.run([*base, *extra], capture_output=True, text=True, env=env, timeout=120)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2, (expect, r.stderr)
        assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
        assert time.monotonic() - t0 < 60
    assert not called.exists()
    assert not (tmp_path / "jobs").exists()


def test_operator_commands(cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = fake_data(tmp_path / "data")
    jobs = tmp_path / "jobs"
    rc, out = submit(["pretrain", "--config", TINY, "--resources", RES, f"data.path={data}",
                      "train.steps=200", f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={jobs}"], capsys)
    jid = job_id(out)
    poll(lambda: last_step(tmp_path / "run") >= 2, 240, "step 2")
    from launch.jobs import cancel_main, jobs_main, logs_main

    assert jobs_main(["--log-dir", str(jobs)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[1].split()[:3] == [jid, "pretrain", "RUNNING"]
    assert logs_main([jid, "--rank", "1", "--stream", "err", "--log-dir", str(jobs)]) == 0
    assert "rank 1/2" in capsys.readouterr().out
    assert cancel_main([jid, "--log-dir", str(jobs)]) == 0
    poll(lambda: slurm_states([jid]).get(jid) == "CANCELLED", 120, "CANCELLED")
    # SIGTERM: the stage saved and stopped without a requeue.
    result = jobs / jid / "result.json"
    res = poll(lambda: result.is_file() and json.loads(result.read_text()), 60, "result.json")
    assert (res["status"], res["stop_reason"]) == ("stopped", "cancel")
    assert not (jobs / jid / "events.jsonl").exists()
    assert (tmp_path / "run" / "ckpt" / "latest").read_text() == str(res["step"])


# ------------------------------------------------------------------------------ the real stages


def cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def mlflow_db(path: Path):
    import sqlite3

    return sqlite3.connect(path)


SYNTH = "data.path=synthetic:classes=4,train=512,val=64"


def test_pretrain_tiny_two_nodes(cluster, tmp_path):
    pytest.importorskip("pipeline.pretrain")
    db = tmp_path / "mlflow.db"
    r = cli(["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, "train.steps=6",
             f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", f"tracking.uri=sqlite:///{db}",
             "--wait"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith("job ")
    c = mlflow_db(db)
    runs = c.execute("select run_uuid from runs").fetchall()
    assert len(runs) == 1
    assert c.execute("select value from tags where key='world_size'").fetchall() == [("2",)]
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_pretrain_preempted_twice_equals_uninterrupted(cluster, tmp_path):
    """The real stage: USR2 twice → collective save, requeue, resume; same losses and weights, one
    MLflow run with every logged step once."""
    pytest.importorskip("pipeline.pretrain")
    steps = 30
    common = ["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, f"train.steps={steps}",
              "train.log_every=1", f"cluster.log_dir={tmp_path / 'jobs'}"]
    ref = cli([*common, f"run.dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path / 'ref.db'}"])
    pre = cli([*common, f"run.dir={tmp_path / 'pre'}", f"tracking.uri=sqlite:///{tmp_path / 'pre.db'}"])
    assert ref.returncode == 0 and pre.returncode == 0, ref.stderr + pre.stderr
    jid = job_id(pre.stdout)
    events = tmp_path / "jobs" / jid / "events.jsonl"
    rng = random.Random(1)
    for i, k in enumerate((rng.randint(2, 8), rng.randint(13, 20))):
        preempt_at(tmp_path / "pre", jid, k, events, i + 1)
    from launch.jobs import outcome, wait

    entries = read_index(tmp_path / "jobs")
    states = wait(entries, timeout_s=900)
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        assert ok, line
    assert json.loads((tmp_path / "jobs" / jid / "result.json").read_text())["restarts"] == 2

    def losses(run):
        return [(r["step"], r["loss"]) for r in metrics(tmp_path / run) if "loss" in r]  # not val lines

    assert [s for s, _ in losses("pre")] == list(range(1, steps + 1))
    assert losses("pre") == losses("ref")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "pre" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    c = mlflow_db(tmp_path / "pre.db")
    assert len(c.execute("select run_uuid from runs").fetchall()) == 1
    loss_steps = [s for (s,) in c.execute("select step from metrics where key='loss' order by step")]
    assert loss_steps == list(range(1, steps + 1))


def test_prep_array_matches_local_prep(cluster, tmp_path):
    from data_prep import prep
    from tests.data_prep_fixtures import build_corpus, tree_bytes

    src = tmp_path / "images"
    build_corpus(src, n_good_per_class=3)
    prep(src, tmp_path / "local", max_samples_per_shard=4, progress=False)
    r = cli(["submit", "prep", str(src), str(tmp_path / "array"), "--tasks", "3", "--max-samples-per-shard", "4",
             "--resources", RES, f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"])
    assert r.returncode == 0, r.stdout + r.stderr
    tasks = [e["job_id"] for e in read_index(tmp_path / "jobs")]
    assert len(tasks) == 3 and len({t.split("_")[0] for t in tasks}) == 1  # one array
    local, array = tree_bytes(tmp_path / "local"), tree_bytes(tmp_path / "array")
    assert sum(n.endswith(".tar") for n in local) >= 3
    assert local.keys() == array.keys()
    assert all(local[n] == array[n] for n in local), [n for n in local if local[n] != array[n]]
