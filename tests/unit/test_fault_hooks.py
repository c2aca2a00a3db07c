"""The test-only pause gate in pipeline.faults.hit: a real process held before a
chosen step, a real signal delivered while it waits, released by the test's file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from launch.job_body import install_stop_handlers
from pipeline import faults
from pipeline import stops
install_stop_handlers()
for step in range(1, 5):
    faults.hit("step", step)
    print(step, stops.stop_reason(), flush=True)
"""


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_pause_gate_holds_the_step_until_released_and_reports_the_signal(tmp_path):
    gate = tmp_path / "gate"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="1", VITP_TEST_PAUSE_AT_STEP="2,4",
               VITP_TEST_PAUSE_FILE=str(gate))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        wait_for(Path(f"{gate}.2.reached.1"), proc)
        assert proc.stdout.readline() == "1 None\n"  # step 1 ran; step 2 is held
        proc.send_signal(signal.SIGUSR2)
        wait_for(Path(f"{gate}.2.stop.1"), proc)
        assert Path(f"{gate}.2.stop.1").read_text() == "requeue"
        assert proc.poll() is None  # still held after the signal
        Path(f"{gate}.2").touch()
        wait_for(Path(f"{gate}.4.reached.1"), proc)
        assert Path(f"{gate}.4.stop.1").read_text() == "requeue"  # already asked: reported at once
        Path(f"{gate}.4").touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert out.splitlines() == ["2 requeue", "3 requeue", "4 requeue"]
    assert not Path(f"{gate}.3.reached.1").exists()


def test_pause_gate_times_out_instead_of_hanging(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), VITP_TEST_PAUSE_AT_STEP="1", VITP_TEST_PAUSE_FILE=str(tmp_path / "g"),
               VITP_TEST_PAUSE_TIMEOUT_S="0.2")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("TimeoutError: VITP_TEST_PAUSE_FILE: ")
    assert Path(f"{tmp_path / 'g'}.1.reached.0").exists()


KILLS = """
from pipeline import faults
for event, at, scope in [("prep_sample", 10, "train-000000"), ("step", 10, ""), ("prep_sample", 9, "train-000001"),
                         ("prep_sample", 10, "train-000001"), ("prep_sample", 11, "train-000001")]:
    faults.hit(event, at, scope)
    print(event, at, scope, flush=True)
"""


def test_prep_kill_matches_shard_and_sample_on_any_rank():
    """VITP_PREP_TEST_KILL_AT=SHARD:K kills the process handling sample K of SHARD, and only it (prep
    workers have no rank: RANK=0 is not spared, unlike the training events)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", VITP_PREP_TEST_KILL_AT="train-000001:10")
    r = subprocess.run([sys.executable, "-c", KILLS], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert r.stdout.splitlines() == ["prep_sample 10 train-000000", "step 10 ", "prep_sample 9 train-000001"]
