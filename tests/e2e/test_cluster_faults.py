"""What a production cluster does to a job, done for real on the local SLURM cluster (2 nodes x 1 task):
a rank SIGKILLed mid-run (as the OOM killer does), a preemption by a job of the higher-priority
partition `urgent` (PreemptMode=REQUEUE: SIGTERM, GraceTime, requeue), and a second job for a run
dir that a live job owns. Each disturbed run must end with the losses and weights of an undisturbed one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.attempts import read_events
from launch.jobs import outcome, read_index, wait
from pipeline.train.checkpoint import complete_checkpoints, tag_for
from tests.e2e.test_submit_slurm import RES, ROOT, SYNTH, TINY, Gate, cli, job_id, losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 10, 4
COMMON = ["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, f"train.steps={STEPS}",
          "train.log_every=1", f"checkpoint.every={EVERY}", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """The undisturbed run every disturbed one must equal."""
    d = tmp_path_factory.mktemp("reference")
    r = cli([*COMMON, f"run.dir={d / 'run'}", f"cluster.log_dir={d / 'jobs'}", "--wait"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return d / "run"


def same_run(run: Path, ref: Path) -> None:
    from safetensors.torch import load_file

    assert [s for s, _ in losses(run)] == list(range(1, STEPS + 1))  # every step logged once
    assert losses(run) == losses(ref)
    a, b = load_file(run / "model.safetensors"), load_file(ref / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def task_pid(jid: str, rank: int) -> int:
    """The pid of rank ``rank``'s Python process of SLURM job ``jid`` (both nodes are this host)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        argv0 = Path(cmd.split(b"\0")[0].decode(errors="replace")).name
        if (env.get("SLURM_JOB_ID") == jid and env.get("SLURM_PROCID") == str(rank) and argv0.startswith("python")
                and b"submitit.core._submit" in cmd):  # the task, not srun (which has SLURM_PROCID=0 too)
            return int(p.name)
    raise AssertionError(f"no process of job {jid} rank {rank}")


def jobs_listing(jobs: Path) -> list[str]:
    r = cli(["jobs", "--log-dir", str(jobs)])
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_killed_rank_comes_back_and_ends_like_an_undisturbed_run(reference, tmp_path):
    """Rank 1 SIGKILLed before step 7 (checkpoint at 4): srun ends the step at once, the batch script
    records "rank 1 killed by SIGKILL" and requeues; the next attempt resumes from step 4."""
    jobs, run, k = tmp_path / "jobs", tmp_path / "run", 7
    gate = Gate(tmp_path / "gate", k)
    r = cli([*COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}"], gate.env)
    assert r.returncode == 0, r.stderr
    jid = job_id(r.stdout)
    gate.held(k, jobs / jid)
    assert complete_checkpoints(run)[-1].name == tag_for(EVERY)
    os.kill(task_pid(jid, 1), signal.SIGKILL)
    Path(f"{gate.path}.{k}").touch()  # the next attempt passes the gate
    entries = read_index(jobs)
    states = wait(entries, timeout_s=600)
    ok, line = outcome(entries[0], states[jid])
    assert ok, line
    ev = read_events(jobs / jid)
    assert [(e["event"], e["restart"]) for e in ev] == [("failed", 0), ("completed", 1)], ev
    assert (ev[0]["rank"], ev[0]["error"], ev[0]["requeued"]) == (1, "killed by SIGKILL", True)
    same_run(run, reference)
    listing = jobs_listing(jobs)
    assert listing[1].split()[:3] == [jid, "pretrain", "COMPLETED"]
    assert listing[2:] == ["  attempt 0: failed: rank 1: killed by SIGKILL; requeued",
                           f"  attempt 1: completed at step {STEPS}"]


def test_max_failures_used_up_stays_failed_with_its_reason(slurm_cluster, tmp_path):
    """cluster.max_failures=0 and rank 0 (the one the batch script runs beside) SIGKILLed: no requeue,
    the job ends FAILED, and `vitp jobs` and `--wait` say why."""
    jobs, run, k = tmp_path / "jobs", tmp_path / "run", 2
    gate = Gate(tmp_path / "gate", k)
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}",
                             "cluster.max_failures=0", "--wait"], cwd=ROOT, env={**os.environ, **gate.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        jid = proc.stdout.readline().split()[1]
        gate.held(k, jobs / jid)
        os.kill(task_pid(jid, 0), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert err.splitlines()[-1] == (f"job {jid} FAILED: killed by SIGKILL (rank 0; cluster.max_failures=0 used up; "
                                    f"logs: vitp logs {jid} --rank 0)")
    ev = read_events(jobs / jid)
    assert [(e["event"], e["rank"], e["requeued"]) for e in ev] == [("failed", 0, False)]
    listing = jobs_listing(jobs)
    assert listing[1].split()[:3] == [jid, "pretrain", "FAILED"]
    assert listing[2:] == ["  attempt 0: failed: rank 0: killed by SIGKILL; not requeued (cluster.max_failures=0 "
                           "used up)"]


def test_preempted_by_urgent_job_saves_comes_back_and_ends_like_an_undisturbed_run(reference, slurm_cluster, tmp_path):
    """A job of partition `urgent` needs both nodes: SLURM sends the training job SIGTERM (no USR2) and
    GraceTime; every rank saves at step k, rank 0 sees the PreemptTime and requeues; the urgent job runs;
    the training job comes back by itself and ends bit-identical to the reference."""
    jobs, run, k = tmp_path / "jobs", tmp_path / "run", 6
    gate = Gate(tmp_path / "gate", k)
    r = cli([*COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}"], gate.env)
    assert r.returncode == 0, r.stderr
    jid = job_id(r.stdout)
    urgent = []

    def preempt():
        u = subprocess.run(["sbatch", "--parsable", f"--partition={slurm_cluster.urgent}", "--nodes=2", "--exclusive",
                            f"--output={tmp_path}/urgent.out", "--wrap", "true"], capture_output=True, text=True)
        assert u.returncode == 0, u.stderr
        urgent.append(u.stdout.strip().split(";")[0])

    gate.signal_and_open(k, jid, jobs / jid, preempt, "cancel")  # TERM: the handler's flag says "cancel"
    entries = read_index(jobs)
    states = wait([*entries, {"job_id": urgent[0], "folder": str(tmp_path), "executor": "slurm"}], timeout_s=600)
    assert states[urgent[0]] == "COMPLETED"
    ok, line = outcome(entries[0], states[jid])
    assert ok, line
    ev = read_events(jobs / jid)
    assert [(e["event"], e["restart"], e["step"]) for e in ev] == [("preempted", 0, k), ("completed", 1, STEPS)]
    assert [p.name for p in complete_checkpoints(run)] == [tag_for(8), tag_for(STEPS)]  # keep: 2
    same_run(run, reference)
    assert jobs_listing(jobs)[2] == f"  attempt 0: preempted at step {k}: saved, requeued"


def test_second_job_for_a_live_run_dir_is_refused(slurm_cluster, tmp_path):
    """While a job trains in RUN_DIR, `vitp submit` of the same command is refused in one line naming
    the run dir and the job (from the index, and from the run dir's claim when another log dir is
    used); nothing of the first job changes and it completes with every step logged once."""
    jobs, run, k = tmp_path / "jobs", tmp_path / "run", 3
    gate = Gate(tmp_path / "gate", k)
    args = [*COMMON, f"run.dir={run}"]
    r = cli([*args, f"cluster.log_dir={jobs}"], gate.env)
    assert r.returncode == 0, r.stderr
    jid = job_id(r.stdout)
    gate.held(k, jobs / jid)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".owner.json"}
    for log_dir in (jobs, tmp_path / "other-jobs"):
        second = cli([*args, f"cluster.log_dir={log_dir}"])
        assert second.returncode == 2, second.stdout + second.stderr
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: run.dir {run} is in use by job {jid} (RUNNING)"), err
    assert not (tmp_path / "other-jobs").exists()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".owner.json"} == before
    Path(f"{gate.path}.{k}").touch()
    states = wait(read_index(jobs), timeout_s=600)
    assert outcome(read_index(jobs)[0], states[jid])[0]
    assert [s for s, _ in losses(run)] == list(range(1, STEPS + 1))
    assert not (run / ".owner.json").exists()  # a completed job gives the run dir up
    assert json.loads((jobs / jid / "result.json").read_text())["status"] == "completed"
