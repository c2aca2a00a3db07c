"""The torch floor: vitp installed beside the oldest torch it admits (requirements-floor.txt), the way
it goes over a cluster image's own torch, runs the tiny pipeline: a 2-rank pre-training (DeepSpeed
ZeRO-2 over gloo) that checkpoints, resumes from DeepSpeed's checkpoint and evaluates, then `vitp eval`
of its weights.

`make test` builds that venv (.venv-floor) and names its python in VITP_FLOOR_PYTHON.
"""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.services import unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
RUN = ["data.path=synthetic:train=512,val=64", "train.log_every=1", "checkpoint.every=2", "tracking.enabled=false",
       "schedule.warmup_steps=2", "schedule.decay=constant"]
LAUNCH = ("import sys; from launch.local import run_local; "
          "sys.exit(run_local(sys.argv[2:], int(sys.argv[1]), timeout=600))")


@pytest.fixture(scope="module")
def floor_python() -> str:
    py = os.environ.get("VITP_FLOOR_PYTHON")
    if not py or not Path(py).is_file():
        unavailable("VITP_FLOOR_PYTHON names no python (`make test` builds .venv-floor with the floor torch)")
    return py


def floor_run(py: str, *argv: str, ranks: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([py, "-c", LAUNCH, str(ranks), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def test_floor_venv_has_the_floor_torch(floor_python):
    want = (ROOT / "requirements-floor.txt").read_text().split("torch==")[1].split()[0]
    r = subprocess.run([floor_python, "-c", "import torch, deepspeed, launch, pipeline; print(torch.__version__); "
                        "print(launch.__file__)"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    version, where = r.stdout.split()[-2:]
    assert version.split("+")[0] == want
    assert Path(where).resolve().parent.parent == ROOT  # this checkout, installed editable


def test_tiny_pipeline_on_the_floor_torch(floor_python, tmp_path):
    run = tmp_path / "pre"
    r = floor_run(floor_python, "pretrain", "--config", TINY, f"run.dir={run}", *RUN, "train.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    # resume from step 2's checkpoint to step 4 (DeepSpeed's load on this torch)
    r = floor_run(floor_python, "pretrain", "--config", TINY, f"run.dir={run}", *RUN, "train.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses.values()) and losses[4] < losses[1]  # it learns
    final = [r for r in recs if "val_top1" in r]
    assert final[-1]["step"] == 4 and final[-1]["val_n"] == 64
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-00000004"

    r = floor_run(floor_python, "eval", "--checkpoint", str(run), "--data", "synthetic:train=512,val=64",
                  "--split", "val", "--out", str(tmp_path / "eval"), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "eval/results.json").read_text())
    # the eval stage scores the same 64 images with the same weights as the run's own final eval
    assert res["eval/val/n"] == 64 and res["eval/val/top1"] == pytest.approx(final[-1]["val_top1"], abs=1e-6)
