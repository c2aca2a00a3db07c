"""A rank that makes no progress leaves its stacks (pipeline/hang.py), and its attempt is requeued like a
dead rank's, naming the stuck rank and its frame (launch/attempts.py). A real process blocked by the
test-fault seam; start-up and busy work longer than cluster.hang_dump_s do not count as a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.attempts import describe, end_of_attempt, read_events
from pipeline import hang

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
from pipeline import faults, hang
hang.watch(sys.argv[1], 1, 1.0)
time.sleep(2.5)  # start-up (build, load, compile) longer than hang_dump_s
print("startup ok", flush=True)
for step in (1, 2, 3):
    faults.hit("step", step)  # step 3: blocked for good on this rank (VITP_TEST_HANG_AT_STEP=3)
    hang.beat()
    with hang.busy():  # a checkpoint longer than hang_dump_s
        time.sleep(2.5)
    print("step", step, flush=True)
"""


def test_a_blocked_rank_dumps_its_stacks_and_ends(tmp_path):
    env = dict(os.environ, RANK="1", VITP_TEST_HANG_AT_STEP="3", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == hang.EXIT_CODE, r.stderr
    assert r.stdout.split("\n")[:3] == ["startup ok", "step 1", "step 2"]  # the long start-up and saves lived
    assert time.monotonic() - t0 > 2.5 + 2 * 2.5 + 1.0
    text = (tmp_path / "hang.1.txt").read_text()
    first = text.splitlines()[0]
    assert first.startswith("hung: no progress for ") and ", stuck in _hang (pipeline/faults.py:" in first
    assert "Current thread" in text or "Thread 0x" in text  # faulthandler's dump of every thread
    assert 'File "<string>"' in text and "in _hang" in text and "vitp-hang-watch" not in first
    rec = json.loads((tmp_path / "error.1.json").read_text())
    assert rec["hang"] is True and rec["waiting"] is False and rec["retry"] is True and rec["rank"] == 1
    assert rec["error"] == first and rec["frame"].startswith("_hang (pipeline/faults.py:")


def _record(folder: Path, rank: int, waiting: bool, frame: str, t: float) -> None:
    line = f"hung: no progress for 3s, {'waiting in a collective' if waiting else 'stuck'} in {frame}; " \
           f"stacks in hang.{rank}.txt"
    (folder / f"error.{rank}.json").write_text(json.dumps(
        {"rank": rank, "restart": 0, "time": t, "error": line, "retry": True, "hang": True, "frame": frame,
         "waiting": waiting}))


def test_a_hang_is_requeued_naming_the_stuck_rank_and_frame(tmp_path):
    folder = tmp_path / "12"
    folder.mkdir()
    # rank 0 waited for rank 1 in the step's all-reduce; srun saw rank 0 end first
    _record(folder, 0, True, "all_reduce (pipeline/distributed.py:270)", 100.0)
    _record(folder, 1, False, "_hang (pipeline/faults.py:80)", 101.0)
    (folder / "12_0_log.err").write_text("vitp: attempt 0 of job 12 starts\n"
                                         "srun: error: node1: task 0: Exited with exit code 3\n")
    requeued = []
    env = {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "0"}
    assert end_of_attempt(tmp_path, 1, max_failures=2, environ=env, requeue=requeued.append) == 0
    assert requeued == ["12"]
    (event,) = read_events(folder)
    assert (event["event"], event["rank"], event["requeued"]) == ("failed", 1, True)
    assert describe(event) == ("attempt 0: failed: rank 1: hung: no progress for 3s, stuck in _hang "
                               "(pipeline/faults.py:80); stacks in hang.1.txt; requeued")


def test_where_tells_a_wait_in_a_collective():
    frame = sys._getframe()
    here, waiting = hang.where(frame)
    assert here.startswith("test_where_tells_a_wait_in_a_collective (") and not waiting  # no vitp frame: itself
    code = compile("import sys\nf = sys._getframe()", "/x/torch/distributed/distributed_c10d.py", "exec")
    ns: dict = {}
    exec(code, ns)
    assert hang.where(ns["f"])[1]
