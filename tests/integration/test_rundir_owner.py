"""Two local launches of the same run dir (launch/local.py, 2 ranks each over gloo): while the first
trains, the second exits 2 with one line naming the run dir and the owner, and changes nothing; the
first completes with every step logged once and gives the run dir up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_second_local_launch_refuses_a_run_dir_in_use(tmp_path):
    run, gate, steps = tmp_path / "run", tmp_path / "gate", 4
    args = ["-m", "launch.cli", "pretrain", "--config", "configs/pretrain/tiny_cpu.yaml",
            "data.path=synthetic:classes=4,train=256,val=32", f"train.steps={steps}", "train.log_every=1",
            f"run.dir={run}", "tracking.enabled=false", "checkpoint.every=2"]
    launch = [sys.executable, "-c", "import sys; from launch.local import run_local; "
              "sys.exit(run_local(sys.argv[1:], 2))"]
    env = {"VITP_TEST_PAUSE_AT_STEP": "3", "VITP_TEST_PAUSE_FILE": str(gate), "PATH": "/usr/bin:/bin"}
    first = subprocess.Popen([*launch, *args[2:]], cwd=ROOT, env={**os.environ, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not all(Path(f"{gate}.3.reached.{r}").exists() for r in range(2)):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.2)
        before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".owner.json"}
        owner = json.loads((run / ".owner.json").read_text())
        second = subprocess.run([*launch, *args[2:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert second.returncode == 2, second.stderr[-2000:]
        errors = {line for line in second.stderr.splitlines() if line.startswith("error: ")}
        assert errors == {f"error: run.dir {run} is in use by pid {owner['pid']} on {owner['host']} "
                          "(running); wait for it to end, cancel it, or choose another "
                          "run.dir"}, second.stderr[-2000:]
        after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".owner.json"}
        assert after == before
        Path(f"{gate}.3").touch()
        out, err = first.communicate(timeout=600)
    finally:  # on a failed assertion: let the paused ranks go, stop the launcher (it stops its ranks), reap it
        Path(f"{gate}.3").touch()
        if first.poll() is None:
            first.terminate()
            first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    assert not (run / ".owner.json").exists()
