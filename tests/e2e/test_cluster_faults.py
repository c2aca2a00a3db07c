"""What a production cluster does to a job, done for real on the local SLURM cluster (2 nodes x 1 task):
a preemption by a job of the higher-priority partition `urgent` (PreemptMode=REQUEUE: SIGTERM,
GraceTime, requeue), a rank SIGKILLed mid-run (as the OOM killer does), a rank that hangs, a second
job for a run dir that a live job owns, and failures beyond cluster.max_failures. The disturbed run
must end with the losses and weights of an undisturbed one.

One job takes every disturbance that it survives (each attempt costs a job start, the slow part here),
and the undisturbed reference trains while the first test's job starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.attempts import read_events
from launch.jobs import outcome, read_index, wait
from pipeline.checkpoint_layout import complete_checkpoints, tag_for
from pipeline.rundir import OWNER
from tests.e2e.test_submit_slurm import RES, ROOT, SYNTH, TINY, Gate, cli, job_id, losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 10, 4
COMMON = ["submit", "pretrain", "--config", TINY, "--resources", RES, SYNTH, f"train.steps={STEPS}",
          "train.log_every=1", f"checkpoint.every={EVERY}", "tracking.enabled=false"]


class Reference:
    """The undisturbed run every disturbed one must equal, submitted without waiting for it."""

    def __init__(self, folder: Path):
        self.jobs, self.run = folder / "jobs", folder / "run"
        r = cli([*COMMON, f"run.dir={self.run}", f"cluster.log_dir={self.jobs}"])
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    def finished(self) -> Path:
        """Wait until the reference completed; its run dir."""
        entries = read_index(self.jobs)
        states = wait(entries, timeout_s=600)
        ok, line = outcome(entries[0], states[entries[0]["job_id"]])
        assert ok, line
        return self.run


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reference"))


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


def files(run: Path) -> dict[str, bytes]:
    """Everything in a run dir but its owner claim (whose heartbeat touches it)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != OWNER}


def test_max_failures_used_up_stays_failed_with_its_reason(reference, tmp_path):
    """cluster.max_failures=0 and rank 0 (the one the batch script runs beside) SIGKILLed: no requeue,
    the job ends FAILED, and `vitp jobs` and `--wait` say why. (Runs while the reference trains.)"""
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


def test_preempted_and_killed_run_comes_back_and_ends_like_an_undisturbed_one(reference, slurm_cluster, tmp_path):
    """Attempt 0, held before step 3: a job of partition `urgent` needs both nodes; SLURM sends TERM (no
    USR2) and GraceTime; every rank saves step 3, rank 0 sees the PreemptTime and requeues; the urgent
    job runs; the job comes back by itself. Attempt 1, held before step 7 (checkpoint at 4): the same
    `vitp submit` is refused in one line naming the run dir and the job (found through the index, and
    through the run dir's claim from another log dir), changing nothing; then rank 1 is SIGKILLed:
    srun ends the step at once, the batch script records "rank 1 killed by SIGKILL" and requeues.
    Attempt 2 resumes from step 4 and ends bit-identical to the reference, giving the run dir up."""
    jobs, run, k1, k2 = tmp_path / "jobs", tmp_path / "run", 3, 7
    gate = Gate(tmp_path / "gate", k1, k2)
    args = [*COMMON, f"run.dir={run}"]
    r = cli([*args, f"cluster.log_dir={jobs}"], gate.env)
    assert r.returncode == 0, r.stderr
    jid = job_id(r.stdout)
    ref = reference.finished()  # the urgent job would preempt it too
    urgent = []

    def preempt():
        u = subprocess.run(["sbatch", "--parsable", f"--partition={slurm_cluster.urgent}", "--nodes=2", "--exclusive",
                            f"--output={tmp_path}/urgent.out", "--wrap", "true"], capture_output=True, text=True)
        assert u.returncode == 0, u.stderr
        urgent.append(u.stdout.strip().split(";")[0])

    gate.signal_and_open(k1, jid, jobs / jid, preempt, "cancel")  # TERM: the handler's flag says "cancel"
    gate.held(k2, jobs / jid)
    assert [(e["event"], e["restart"], e["step"]) for e in read_events(jobs / jid)] == [("preempted", 0, k1)]
    assert wait([{"job_id": urgent[0], "folder": str(tmp_path), "executor": "slurm"}], timeout_s=120)[urgent[0]] == \
        "COMPLETED"
    assert complete_checkpoints(run)[-1].name == tag_for(EVERY)

    before = files(run)
    for log_dir in (jobs, tmp_path / "other-jobs"):
        second = cli([*args, f"cluster.log_dir={log_dir}"])
        assert second.returncode == 2, second.stdout + second.stderr
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: run.dir {run} is in use by job {jid} (RUNNING)"), err
    assert not (tmp_path / "other-jobs").exists() and len(read_index(jobs)) == 1
    assert files(run) == before

    os.kill(task_pid(jid, 1), signal.SIGKILL)
    Path(f"{gate.path}.{k2}").touch()  # the next attempt passes the gate
    entries = read_index(jobs)
    states = wait(entries, timeout_s=600)
    ok, line = outcome(entries[0], states[jid])
    assert ok, line
    ev = read_events(jobs / jid)
    assert [(e["event"], e["restart"]) for e in ev] == [("preempted", 0), ("failed", 1), ("completed", 2)], ev
    assert (ev[1]["rank"], ev[1]["error"], ev[1]["requeued"]) == (1, "killed by SIGKILL", True)
    assert [p.name for p in complete_checkpoints(run)] == [tag_for(8), tag_for(STEPS)]  # keep: 2
    same_run(run, ref)
    assert not (run / OWNER).exists()  # a completed job gives the run dir up
    listing = jobs_listing(jobs)
    assert listing[1].split()[:3] == [jid, "pretrain", "COMPLETED"]
    assert listing[2:] == [f"  attempt 0: preempted at step {k1}: saved, requeued",
                           "  attempt 1: failed: rank 1: killed by SIGKILL; requeued",
                           f"  attempt 2: completed at step {STEPS}"]


def test_a_hung_rank_leaves_its_stacks_and_the_requeued_run_ends_like_an_undisturbed_one(reference, tmp_path):
    """Attempt 0: rank 1 blocks before step 6 outside any collective (the test fault; rank 0 then waits
    in the step's all-reduce). After cluster.hang_dump_s without a step it writes hang.1.txt and ends;
    srun ends the step, the batch script records the stuck rank and its frame and requeues. Attempt 1
    resumes from step 4 and ends bit-identical to the reference."""
    jobs, run = tmp_path / "jobs", tmp_path / "run"
    r = cli([*COMMON, f"run.dir={run}", f"cluster.log_dir={jobs}", "cluster.hang_dump_s=3", "--wait"],
            {"VITP_TEST_HANG_AT_STEP": "6", "VITP_TEST_KILL_RANK": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jid = job_id(r.stdout)
    ev = read_events(jobs / jid)
    assert [(e["event"], e["restart"]) for e in ev] == [("failed", 0), ("completed", 1)], ev
    assert (ev[0]["rank"], ev[0]["requeued"]) == (1, True)
    stacks = (jobs / jid / "hang.1.txt").read_text()
    assert stacks.startswith("hung: no progress for ") and "in _hang" in stacks and "pipeline/train/loop.py" in stacks
    same_run(run, reference.finished())
    listing = jobs_listing(jobs)
    assert listing[2].startswith("  attempt 0: failed: rank 1: hung: no progress for ")
    assert ", stuck in _hang (pipeline/faults.py:" in listing[2]
    assert listing[2].endswith("; stacks in hang.1.txt; requeued")
    assert listing[3:] == [f"  attempt 1: completed at step {STEPS}"]
