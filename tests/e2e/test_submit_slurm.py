"""`vitp submit` on the real local SLURM cluster (2 nodes x 1 task, CPU, gloo), with the real stages
over shards written by `vitp prep`: two preemptions that resume exactly, the requeue limit, cancel and
the operator commands, a job that fails after submission, mistakes caught before sbatch, prep arrays.

Signals land at the step a test chooses, not when the machine's load decides: every rank waits at a
gate before that step (VITP_TEST_PAUSE_*, pipeline.faults.hit); the test signals the
job, waits until every rank has seen the signal, then opens the gate. The loop agrees on a stop at the
step it was asked for only on steps that sync anyway (log, eval, save) and one step later otherwise,
so these tests log every step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.jobs import job_state, outcome, read_index, slurm_states, wait
from pipeline import error_record
from pipeline.checkpoint_layout import complete_checkpoints, tag_for
from tests.data_prep_fixtures import build_corpus, tree_bytes

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/pretrain/tiny_cpu.yaml"
RES = "configs/cluster/local_debug.yaml"
SYNTH = "data.path=synthetic:classes=4,train=512,val=64"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def cluster(request):
    """The local cluster (tests/services.py's fixture)."""
    return request.getfixturevalue("slurm_cluster")


@pytest.fixture
def shards(corpus_shards) -> Path:
    """Real images through `vitp prep` (tests/conftest.py, shared with the preflight tests): 3 classes,
    3 train shards of <= 16 samples, a val split."""
    return corpus_shards


def cli(args: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def start(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`vitp ARGS` in the background (e.g. `submit ... --wait`); returns it once it printed `job <id>`."""
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("job "), first + proc.communicate()[1][-2000:]
    return proc, first.split()[1]


def job_id(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("job "))


def poll(pred, timeout_s: float, what: str, folder: Path | None = None):
    """Wait for a condition; fail at once with the job's error if the job in ``folder`` failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if folder is not None and error_record.read(folder):
            raise AssertionError(f"job failed while waiting for {what}: {error_record.read(folder)}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Gate:
    """The test side of the pause gate: ranks wait before each of ``steps``."""

    def __init__(self, path: Path, *steps: int, ranks: int = 2):
        self.path, self.steps, self.ranks = path, steps, ranks

    @property
    def env(self) -> dict:
        return {"VITP_TEST_PAUSE_AT_STEP": ",".join(map(str, self.steps)), "VITP_TEST_PAUSE_FILE": str(self.path)}

    def _all(self, k: int, what: str) -> bool:
        return all(Path(f"{self.path}.{k}.{what}.{r}").exists() for r in range(self.ranks))

    def held(self, k: int, folder: Path) -> None:
        poll(lambda: self._all(k, "reached"), 600, f"every rank at the gate before step {k}", folder)

    def signal_and_open(self, k: int, jid: str, folder: Path, send, reason: str) -> None:
        """Every rank is held before step k: ``send()`` the signal, wait until every rank saw it, open."""
        self.held(k, folder)
        send()
        poll(lambda: self._all(k, "stop"), 120, f"every rank to see the signal before step {k}", folder)
        assert {Path(f"{self.path}.{k}.stop.{r}").read_text() for r in range(self.ranks)} == {reason}
        Path(f"{self.path}.{k}").touch()


def usr2(jid: str):
    return lambda: subprocess.run(["scancel", "--signal=USR2", jid], check=True)


def metrics(run: Path) -> list[dict]:
    m = run / "metrics.jsonl"
    return [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else []


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run) if "loss" in r]  # not the val lines


def n_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


# ------------------------------------------------------------------------------------------------ tests


def test_pretrain_two_nodes_completes(cluster, tmp_path):
    """The fast case (synthetic data): submit --wait, one MLflow run over 2 ranks, the index, the weights.
    The submitting shell has a stale MASTER_ADDR/MASTER_PORT (an unroutable address), which sbatch
    exports into the job: the allocation's master is used all the same."""
    db, jobs = tmp_path / "mlflow.db", tmp_path / "jobs"
    r = cli(["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, "train.steps=6",
             f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={jobs}", f"tracking.uri=sqlite:///{db}", "--wait"],
            env={"MASTER_ADDR": "203.0.113.7", "MASTER_PORT": "9"})
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(r.stdout)
    *_, done, tracked = r.stdout.splitlines()  # the outcome, then what tracking did
    assert done == f"job {jid} COMPLETED status=completed step=6 (logs: vitp logs {jid})"
    assert tracked == f"job {jid} tracking: delivered"
    res = json.loads((jobs / jid / "result.json").read_text())
    assert (res["status"], res["step"], res["world_size"], res["restarts"]) == ("completed", 6, 2, 0)
    assert [e["job_id"] for e in read_index(jobs)] == [jid] and (jobs / jid / "config.yaml").is_file()
    import sqlite3

    c = sqlite3.connect(db)
    assert len(c.execute("select run_uuid from runs").fetchall()) == 1
    assert c.execute("select value from tags where key='world_size'").fetchall() == [("2",)]
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_preempted_twice_over_real_shards_equals_uninterrupted(cluster, shards, tmp_path):
    """USR2 before steps 7 and 16: every rank finishes that step, saves, the job requeues itself and
    resumes (model, optimizer, RNG, loader position inside the checkpoint, loader workers on) and ends
    with the losses and weights of an uninterrupted run, every step logged once, one MLflow run."""
    steps, k1, k2 = 24, 7, 16
    jobs = tmp_path / "jobs"
    common = ["submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={shards}",
              f"train.steps={steps}", "train.log_every=1", f"cluster.log_dir={jobs}"]
    gate = Gate(tmp_path / "gate", k1, k2)
    ref = cli([*common, f"run.dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path / 'ref.db'}"])
    pre = cli([*common, f"run.dir={tmp_path / 'pre'}", f"tracking.uri=sqlite:///{tmp_path / 'pre.db'}"], gate.env)
    assert ref.returncode == 0 and pre.returncode == 0, ref.stderr + pre.stderr
    jid = job_id(pre.stdout)
    folder, events = jobs / jid, jobs / jid / "events.jsonl"
    for i, k in enumerate((k1, k2)):
        gate.signal_and_open(k, jid, folder, usr2(jid), "requeue")
        poll(lambda i=i: n_lines(events) > i, 300, f"requeue #{i + 1}", folder)  # one line per attempt
    entries = read_index(jobs)
    states = wait(entries, timeout_s=900)
    for e in entries:
        ok, line = outcome(e, states[e["job_id"]])
        assert ok, line
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    assert [(e["event"], e["restart"], e["step"]) for e in ev] == [("requeued", 0, k1), ("requeued", 1, k2),
                                                                    ("completed", 2, steps)]
    assert json.loads((folder / "result.json").read_text())["restarts"] == 2
    pre_run, ref_run = tmp_path / "pre", tmp_path / "ref"
    assert [p.name for p in complete_checkpoints(pre_run)] == [tag_for(k2), tag_for(steps)]  # keep: 2
    assert [s for s, _ in losses(pre_run)] == list(range(1, steps + 1))
    assert losses(pre_run) == losses(ref_run)
    from safetensors.torch import load_file

    a, b = load_file(pre_run / "model.safetensors"), load_file(ref_run / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    import sqlite3

    c = sqlite3.connect(tmp_path / "pre.db")
    assert len(c.execute("select run_uuid from runs").fetchall()) == 1
    assert [s for (s,) in c.execute("select step from metrics where key='loss' order by step")] == list(
        range(1, steps + 1))


def test_requeue_limit_fails_the_wait_and_resubmitting_resumes(cluster, shards, tmp_path):
    """cluster.max_requeues=1: the first USR2 requeues, the second is refused with its reason and
    `--wait` exits 1 with it; the checkpoint is there, and submitting again finishes the run."""
    steps, k1, k2 = 10, 3, 6
    jobs, run = tmp_path / "jobs", tmp_path / "run"
    args = ["submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={shards}", f"train.steps={steps}",
            "cluster.max_requeues=1", f"run.dir={run}", f"cluster.log_dir={jobs}", "tracking.enabled=false",
            "train.log_every=1", "--wait"]  # every step syncs: a stop asked before step k lands at step k
    gate = Gate(tmp_path / "gate", k1, k2)
    proc, jid = start(args, gate.env)
    try:
        gate.signal_and_open(k1, jid, jobs / jid, usr2(jid), "requeue")
        gate.signal_and_open(k2, jid, jobs / jid, usr2(jid), "requeue")
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert re.fullmatch(rf"job {jid} FAILED: RequeueLimitError: stopped at step {k2}: job already requeued 1 times "
                        rf"\(cluster.max_requeues=1\); resubmit to resume from the checkpoint \(rank [01]; logs: "
                        rf"vitp logs {jid} --rank [01]\)", err.splitlines()[-1]), err[-2000:]
    ev = [json.loads(x) for x in (jobs / jid / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"]) for e in ev] == [("requeued", 0), ("failed", 1)]  # not retried
    assert ev[1]["requeued"] is False and ev[1]["error"].startswith("RequeueLimitError: stopped at step")
    assert complete_checkpoints(run)[-1].name == tag_for(k2)
    again = cli(args)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    res = json.loads((jobs / job_id(again.stdout) / "result.json").read_text())
    assert (res["status"], res["step"]) == ("completed", steps)
    assert [s for s, _ in losses(run)] == list(range(1, steps + 1))  # each step logged once


def test_operator_commands_and_cancel_on_the_real_stage(cluster, shards, tmp_path):
    """Held before step 3: `vitp jobs` lists it RUNNING, `vitp logs` shows each rank's log; a plain
    `scancel` (SIGTERM; no mark of `vitp cancel`: rank 0 learns from SLURM that this TERM is no
    preemption) makes every rank finish step 3, save it and stop without a requeue."""
    k, jobs, run = 3, tmp_path / "jobs", tmp_path / "run"
    gate = Gate(tmp_path / "gate", k)
    r = cli(["submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={shards}", "train.steps=50",
             "train.log_every=1", f"run.dir={run}", f"cluster.log_dir={jobs}", "tracking.enabled=false"], gate.env)
    assert r.returncode == 0, r.stderr
    jid = job_id(r.stdout)
    gate.held(k, jobs / jid)
    listing = cli(["jobs", "--log-dir", str(jobs)])
    assert listing.returncode == 0
    row = listing.stdout.splitlines()[1].split()
    assert (row[:3], row[5], row[6]) == ([jid, "pretrain", "RUNNING"], "2", str(run))
    err1 = cli(["logs", jid, "--rank", "1", "--stream", "err", "--log-dir", str(jobs)])
    assert err1.returncode == 0 and "vitp: pretrain rank 1/2" in err1.stdout
    out0 = cli(["logs", jid, "--rank", "0", "--stream", "out", "--log-dir", str(jobs)])
    assert re.search(r"^step +2/50\b", out0.stdout, flags=re.M), out0.stdout[-2000:]

    def cancel():
        subprocess.run(["scancel", jid], check=True)

    gate.signal_and_open(k, jid, jobs / jid, cancel, "cancel")
    poll(lambda: slurm_states([jid]).get(jid) == "CANCELLED", 120, "CANCELLED")
    res = json.loads((jobs / jid / "result.json").read_text())
    assert (res["status"], res["stop_reason"], res["step"]) == ("stopped", "cancel", k)
    ev = [json.loads(x) for x in (jobs / jid / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["step"]) for e in ev] == [("cancelled", 0, k)]
    assert complete_checkpoints(run)[-1].name == tag_for(k)
    entry = read_index(jobs)[0]
    assert job_state(entry) == "CANCELLED"
    assert outcome(entry, "CANCELLED") == (False, f"job {jid} CANCELLED status=stopped step={k} stop_reason=cancel "
                                                  f"(logs: vitp logs {jid})")
    listing = cli(["jobs", "--log-dir", str(jobs)]).stdout.splitlines()
    assert listing[1].split()[2] == "CANCELLED"
    assert listing[2] == f"  attempt 0: cancelled at step {k} (checkpoint saved)"


def test_wait_ends_when_the_dataset_vanished_after_submission(cluster, shards, tmp_path):
    data, jobs = tmp_path / "data", tmp_path / "jobs"
    shutil.copytree(shards, data)
    gate = Gate(tmp_path / "gate", 0)  # before the stage starts
    proc, jid = start(["submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={data}",
                       f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={jobs}", "--wait"], gate.env)
    try:
        gate.held(0, jobs / jid)
        shutil.rmtree(data)
        Path(f"{gate.path}.0").touch()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert re.fullmatch(rf"job {jid} FAILED: DataError: {data}/_info.json: not found \(is data.path a `vitp prep` "
                        rf"output folder, and did prep finish\?\) \(rank ([01]); logs: vitp logs {jid} --rank \1\)",
                        err.splitlines()[-1]), err[-2000:]


def fake_data(path: Path, splits: tuple[str, ...] = ("train",)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    info = {"splits": {s: {"filenames": [f"{s}-000000.tar"]} for s in splits}}
    (path / "_info.json").write_text(json.dumps(info))
    return path


def test_bad_submissions_fail_before_sbatch(cluster, tmp_path):
    """Unknown partition, nodes=0, missing data, a split prep did not write: one line, exit 2, no sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "sbatch-called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    data = fake_data(tmp_path / "data", ("train", "val"))
    base = ["submit", "pretrain", "--config", TINY, "--resources", RES, f"cluster.log_dir={tmp_path / 'jobs'}"]
    cases = {
        "cluster.partition: unknown partition 'nope'": [f"data.path={data}", "cluster.partition=nope"],
        "cluster.nodes: must be >= 1; got 0": [f"data.path={data}", "cluster.nodes=0"],
        "_info.json: not found": [f"data.path={tmp_path / 'missing'}"],
        "data.val_split: 'val' not in": [f"data.path={fake_data(tmp_path / 'noval')}"],
    }
    for expect, extra in cases.items():
        t0 = time.monotonic()
        r = cli([*base, *extra], env, timeout=120)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2, (expect, r.stderr)
        assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
        assert time.monotonic() - t0 < 60
    assert not called.exists()
    assert not (tmp_path / "jobs").exists()


def test_prep_array_matches_local_prep(cluster, tmp_path):
    from data_prep import prep

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
