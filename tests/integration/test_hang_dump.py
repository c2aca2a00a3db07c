"""A rank that blocks outside any collective (the test-fault seam) in a real 2-rank pre-training job,
submitted through submitit's local executor as a SLURM task would run: after cluster.hang_dump_s
without a step it dumps every thread's stack into the job folder and ends, and the job's outcome names
the stuck rank and the frame it stood in (on SLURM the batch script then requeues it:
tests/unit/test_hang.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_stuck_rank_leaves_its_stacks_in_the_job_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               VITP_TEST_HANG_AT_STEP="3", VITP_TEST_KILL_RANK="1")
    r = subprocess.run([sys.executable, "-m", "launch.cli", "submit", "pretrain", "--cluster", "local",
                        "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"), "data.path=synthetic",
                        "data.val_split=", "model.depth=1", "train.steps=6", "train.log_every=1",
                        "checkpoint.every=0", "tracking.enabled=false", "cluster.hang_dump_s=3",
                        f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    (folder,) = [p for p in (tmp_path / "jobs").iterdir() if p.name.isdigit()]
    line = next(x for x in (r.stdout + r.stderr).splitlines() if " FAILED: " in x)  # `--wait`: the outcome
    assert ": hung: no progress for " in line and ", stuck in _hang (pipeline/faults.py:" in line
    assert line.endswith("stacks in hang.1.txt (rank 1; logs: vitp logs " + folder.name + " --rank 1)")
    stacks = (folder / "hang.1.txt").read_text()
    main = stacks[stacks.index("most recent call first"):]  # the threads' stacks, innermost first
    assert "in _hang" in main and "pipeline/train/loop.py" in main and "in train" in main
    rec = json.loads((folder / "error.1.json").read_text())
    assert (rec["hang"], rec["waiting"], rec["retry"]) == (True, False, True)
    # blocked at step 3: steps 1 and 2 were done and logged, no later one
    steps = [json.loads(x)["step"] for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
