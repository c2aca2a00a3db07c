"""A run resumed mid log window logs what the uninterrupted run logs, step for step: the window's
device-side sums are part of the checkpoint (killed at step 7, resumed from the step-4 checkpoint,
the step-5 record still averages steps 1-5)."""

import json
from pathlib import Path

import pytest

from launch.local import run_local

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
ARGS = ["pretrain", "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"), "data.path=synthetic:train=512,val=32",
        "model.depth=2", "train.log_every=5", "checkpoint.every=4", "train.steps=10", "tracking.enabled=false",
        "schedule.warmup_steps=2", "schedule.decay=constant"]


def records(run_dir) -> list[dict]:
    keep = ("step", "loss", "top1")
    return [{k: r[k] for k in keep} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def test_resume_inside_a_log_window_logs_the_same_records(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_local([*ARGS, f"run.dir={whole}"], 2, timeout=900) == 0
    assert run_local([*ARGS, f"run.dir={killed}"], 2, env={"VITP_TEST_KILL_AT_STEP": "7"}, timeout=900) != 0
    assert [r["step"] for r in records(killed)] == [5]  # logged before the kill; resume trims nothing <= 4
    assert run_local([*ARGS, f"run.dir={killed}"], 2, timeout=900) == 0
    assert [r["step"] for r in records(whole)] == [5, 10]
    assert records(killed) == records(whole)  # step 5 re-run from the step-4 window: equal, bit for bit
