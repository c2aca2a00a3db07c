"""A run dir is owned by one job at a time (pipeline/rundir.py), with real processes as owners: a live
owner refuses a second job in one line, a dead one (its process gone, its heartbeat stale, its SLURM
job ended) does not hold the run dir, and a requeued attempt of the owning job takes its claim over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pipeline import rundir
from pipeline.rundir import OWNER, RunDirBusy, busy, claim, me, owner_alive, release


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p
    p.kill()
    p.wait()


def owner_of(pid: int, **kw) -> dict:
    return {**me(), "job": None, "restart": 0, "pid": pid, "pid_start": rundir._proc_start(pid), **kw}


def test_live_process_on_this_host_owns_until_it_dies(tmp_path, sleeper):
    other = owner_of(sleeper.pid)
    assert claim(tmp_path, other) == other
    before = (tmp_path / OWNER).read_bytes()
    with pytest.raises(RunDirBusy) as e:
        claim(tmp_path)
    assert str(e.value) == (f"run.dir {tmp_path} is in use by pid {sleeper.pid} on {other['host']} (running); "
                            "wait for it to end, cancel it, or choose another run.dir")
    assert (tmp_path / OWNER).read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [OWNER]
    sleeper.kill()
    sleeper.wait()
    mine = claim(tmp_path)  # the dead owner left its file behind: taken over
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
    release(tmp_path, mine)
    assert not (tmp_path / OWNER).exists()


def test_pid_reused_by_another_process_is_not_the_owner(tmp_path, sleeper):
    assert busy(tmp_path) is None
    claim(tmp_path, owner_of(sleeper.pid, pid_start="1"))  # same pid, another start time
    assert busy(tmp_path) is None


def test_owner_on_another_host_lives_by_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setenv("VITP_RUNDIR_LEASE_S", "60")
    far = {"job": None, "restart": 0, "host": "elsewhere", "pid": 1, "pid_start": "5", "since": time.time()}
    mine = me()
    assert owner_alive(far, mine, beat=time.time() - 10) == (True, "heartbeat 10s ago")
    assert owner_alive(far, mine, beat=time.time() - 61) == (False, "no heartbeat")


def test_slurm_owner_lives_while_squeue_lists_it_and_its_requeued_attempt_takes_over(monkeypatch):
    states = {"41": "PENDING", "42": ""}
    monkeypatch.setattr(rundir, "slurm_state", lambda job: states[job])  # squeue's answers
    job = {"job": "41", "restart": 0, "host": "node9", "pid": 7, "pid_start": "1", "since": 0.0}
    old = time.time() - 3600  # no heartbeat for an hour: a queued (requeued) job still owns the run dir
    assert owner_alive(job, me({}), beat=old) == (True, "PENDING")
    assert owner_alive({**job, "job": "42"}, me({}), beat=old) == (False, "ended")
    attempt = me({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"})
    assert owner_alive(job, attempt, beat=time.time()) == (False, "an earlier attempt of this job")


def test_heartbeat_keeps_the_claim_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("VITP_RUNDIR_LEASE_S", "0.4")
    claim(tmp_path)
    os.utime(tmp_path / OWNER, (time.time() - 100, time.time() - 100))
    beat = rundir.Heartbeat(tmp_path)
    try:
        deadline = time.monotonic() + 10
        while time.time() - (tmp_path / OWNER).stat().st_mtime > 50 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    assert time.time() - (tmp_path / OWNER).stat().st_mtime < 5
