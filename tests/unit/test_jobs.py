"""How a job's end is read: SLURM's state while it remembers the job, then what the job left
(result.json, error.<rank>.json). A scheduler that has forgotten a job is simulated by squeue/sacct
stand-ins on PATH (MinJobAge cannot be waited out in a test); the rest is real files and processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.jobs import GONE, job_state, outcome, slurm_states, wait
from pipeline import error_record
from pipeline.data.shards import DataError
from pipeline.error_record import error_line, write_error


def fake_slurm(tmp_path: Path, monkeypatch, squeue_lines: str = "", squeue_rc: int = 0, sacct: bool = False) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\nprintf '{squeue_lines}'\nexit {squeue_rc}\n")
    (bin_dir / "squeue").chmod(0o755)
    (bin_dir / "sacct").unlink(missing_ok=True)
    if sacct:
        (bin_dir / "sacct").write_text("#!/bin/sh\nprintf '77|COMPLETED\\n'\n")
        (bin_dir / "sacct").chmod(0o755)
    # only the stand-ins: a real sacct/squeue of this machine must not answer
    monkeypatch.setenv("PATH", str(bin_dir))


def entry(folder: Path, jid: str = "77", executor: str = "slurm") -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    return {"job_id": jid, "folder": str(folder), "executor": executor}


def test_error_line_is_the_tracebacks_last_line():
    assert error_line(DataError("x/_info.json: not found")) == "DataError: x/_info.json: not found"
    assert error_line(RuntimeError("first\nsecond")) == "RuntimeError: ... second"


def test_slurm_states_tell_gone_from_unreachable(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, "12|RUNNING\\n13_1|PENDING\\n")
    assert slurm_states(["12", "13_1", "14"]) == {"12": "RUNNING", "13_1": "PENDING", "14": GONE}
    fake_slurm(tmp_path, monkeypatch, "", sacct=True)
    assert slurm_states(["77", "78"]) == {"77": "COMPLETED", "78": GONE}
    fake_slurm(tmp_path, monkeypatch, "", squeue_rc=1)  # slurmctld not answering: nothing is known
    assert slurm_states(["77"]) == {}


def test_forgotten_slurm_job_ends_the_wait_with_its_error(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch)  # squeue answers, lists nothing; no sacct
    failed = entry(tmp_path / "77")
    write_error(tmp_path / "77", 1, DataError("s/_info.json: not found"))
    write_error(tmp_path / "77", 0, RuntimeError("Connection closed by peer"))  # later: a consequence
    assert [e["rank"] for e in error_record.read(tmp_path / "77")] == [1, 0]
    killed = entry(tmp_path / "78", "78")  # left nothing at all
    done = entry(tmp_path / "79", "79")
    (tmp_path / "79" / "result.json").write_text(json.dumps({"status": "completed", "step": 6}))
    states = wait([failed, killed, done], poll_s=0.01, timeout_s=30)
    assert states == {"77": "FAILED", "78": "FAILED", "79": "COMPLETED"}
    assert outcome(failed, "FAILED") == (
        False, "job 77 FAILED: DataError: s/_info.json: not found (rank 1; logs: vitp logs 77 --rank 1)")
    ok, line = outcome(killed, "FAILED")
    assert not ok and line.startswith("job 78 FAILED: no result.json and no error record")
    assert outcome(done, "COMPLETED") == (True, "job 79 COMPLETED status=completed step=6 (logs: vitp logs 79)")
    fake_slurm(tmp_path, monkeypatch, squeue_rc=1)
    assert job_state(killed) == "UNKNOWN"  # scheduler unreachable: not ended, keep waiting
    assert job_state(done) == "COMPLETED"


def test_local_job_state_follows_the_controller_process(tmp_path):
    # a process whose command line names submitit, as the local executor's controller does
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "submitit.local._local"],
                            stdin=subprocess.PIPE)
    e = entry(tmp_path / "j", str(proc.pid), "local")
    try:
        assert job_state(e) == "RUNNING"
        write_error(tmp_path / "j", 0, ValueError("bad"))
        assert job_state(e) == "RUNNING"  # other ranks may still be shutting down
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert job_state(e) == "FAILED"
    pid = proc.pid
    assert outcome(e, "FAILED")[1] == f"job {pid} FAILED: ValueError: bad (rank 0; logs: vitp logs {pid} --rank 0)"
    zombie = subprocess.Popen([sys.executable, "-c", "pass", "submitit.local._local"])
    ze = entry(tmp_path / "z", str(zombie.pid), "local")
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.01)  # not reaped (no wait()): it stays a zombie, as an unreaped controller does
    assert job_state(ze) == "FAILED"
    zombie.wait()
    mine = entry(tmp_path / "k", str(os.getpid()), "local")  # a live pid that is not a controller
    assert job_state(mine) == "FAILED"
    (tmp_path / "k" / "result.json").write_text(json.dumps({"status": "stopped", "stop_reason": "cancel", "step": 3}))
    assert job_state(mine) == "CANCELLED"
    assert outcome(mine, "CANCELLED")[0] is False


@pytest.mark.parametrize("status", [None, "completed"])
def test_outcome_needs_both_scheduler_and_stage(tmp_path, status):
    e = entry(tmp_path / "j")
    if status:
        (tmp_path / "j" / "result.json").write_text(json.dumps({"status": status, "step": 2}))
    assert outcome(e, "COMPLETED")[0] is bool(status)
    assert outcome(e, "NODE_FAIL")[0] is False


def test_the_error_record_has_one_writer_and_one_reader():
    """pipeline/error_record.py is the only code that names the record's file: a second writer or reader
    (the job body's, the hang watchdog's, `vitp jobs`', the batch script's were four) fails here."""
    import re

    root = Path(__file__).resolve().parents[2]
    naming = re.compile(r"error\.(\{|\*)")
    found = sorted(p.relative_to(root).as_posix() for d in ("pipeline", "launch", "data_prep")
                   for p in (root / d).rglob("*.py") if naming.search(p.read_text(encoding="utf-8")))
    assert found == ["pipeline/error_record.py"]
