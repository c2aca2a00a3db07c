"""The ViT-H recipe's path and per-task GPU binding on a real GPU, through vitp's own commands, plus
`vitp preflight` on one GPU. Skipped (with the reason) where CUDA is not usable; where GPUs were
asked for, tests/gpu/conftest.py turns a skip into a failure.

- bf16 + ZeRO-3 + activation checkpointing (configs/pretrain/vit_h14.yaml's engine), a small model:
  trains, losses finite and falling, on the GPU.
- per-task binding (srun --gpus-per-task=1 / --gpu-bind): the task sees one GPU while LOCAL_RANK is 1;
  ZeRO-3 must keep allocating on the device the rank took, past step 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local import run_local
from pipeline.distributed import cuda_problem
from pipeline.network import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
_PROBLEM = cuda_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_PROBLEM is not None, reason=f"needs a CUDA GPU: {_PROBLEM}")]

SYNTH = "data.path=synthetic:classes=4,train=512,val=64"
H14_PATH = ["engine.precision=bf16", "engine.zero_stage=3", "model.grad_checkpointing=true", "engine.backend=nccl",
            "cluster.tasks_per_node=1", "tracking.enabled=false", "data.workers=1", "train.global_batch=32",
            "train.micro_batch=16", "train.steps=6", "train.log_every=1", "checkpoint.every=0",
            "schedule.warmup_steps=2", "schedule.decay=constant", "train.compile=false"]


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("cuda_max_gb", 0) > 0 for r in recs), "metrics.jsonl shows no CUDA memory"
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_bf16_zero3_activation_checkpointing(tmp_path):
    run = tmp_path / "run"
    assert run_local(["pretrain", "--config", TINY, f"run.dir={run}", SYNTH, *H14_PATH], 1, timeout=600) == 0
    got = _losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in got.values())
    assert got[6] < got[1]
    assert (run / "model.safetensors").is_file()


def test_per_task_binding_local_rank_1_sees_one_gpu(tmp_path):
    run = tmp_path / "run"
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("DS_ACCELERATOR", None)
    r = subprocess.run([sys.executable, "-m", "launch.cli", "pretrain", "--config", TINY, f"run.dir={run}", SYNTH,
                        *H14_PATH, "train.steps=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert sorted(_losses(run)) == [1, 2, 3]


def test_preflight_on_one_gpu(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launch.cli", "preflight", "--config", TINY, "--cluster", "local", SYNTH,
                        f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", "cluster.nodes=1",
                        "cluster.tasks_per_node=1", "cluster.gpus_per_node=1", "engine.backend=nccl",
                        "--io-mb", "64", "--allreduce-mb", "64"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout
    assert any(line.startswith("driver") and " ok " in line for line in table.splitlines())
    assert any(line.startswith("gpus") and "1 visible -> cuda:0" in line for line in table.splitlines())
