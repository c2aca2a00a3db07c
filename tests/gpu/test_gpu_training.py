"""vitp on a real GPU, through its real commands: one rank, NCCL, DeepSpeed ZeRO-2, bf16, over shards
written by `vitp prep`. Skipped (with the reason) wherever CUDA is not usable, which includes CI.

- pretrain, killed mid-run (SIGKILL before step 5) and resumed: the resumed run logs every step once,
  with the uninterrupted run's losses within bf16 tolerance; then `vitp eval` scores the run.
- `vitp submit pretrain --cluster local` from a process whose environment says DS_ACCELERATOR=cpu
  (what a GPU-less login node used to export): the job decides on its node and trains on the GPU, with
  compiled blocks (the GPU default).

Every other run here is uncompiled (``train.compile=false``): a cold compile of the tiny model costs
more than its six steps, and the compiled path is the submit test's and the GPU check's pretrain part's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch.local import run_local
from pipeline.distributed import cuda_problem
from tests.data_prep_fixtures import jpeg_bytes, natural_image

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny_cpu.yaml")
_PROBLEM = cuda_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_PROBLEM is not None, reason=f"needs a CUDA GPU: {_PROBLEM}")]

CLASSES, PER_CLASS = 3, 32
# 6 steps of 2 micro batches; constant lr after warm-up; a checkpoint every 2 steps
GPU = ["engine.precision=bf16", "engine.zero_stage=2", "engine.backend=nccl", "cluster.tasks_per_node=1",
       "tracking.enabled=false", "data.workers=1", "train.global_batch=32", "train.micro_batch=16",
       "train.compile=false"]
RUN = [*GPU, "train.steps=6", "train.log_every=1", "checkpoint.every=2", "schedule.warmup_steps=2",
       "schedule.decay=constant"]
BF16_REL = 1e-2  # ~2.5 bf16 ulps: GPU kernels (attention backward) are not bitwise deterministic run to run


def _env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _vitp(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _assert_trained_on_cuda(run_dir: Path) -> None:
    mem = [r["cuda_max_gb"] for r in _records(run_dir) if "loss" in r and "cuda_max_gb" in r]
    assert mem and min(mem) > 0.0, "metrics.jsonl shows no CUDA memory: the run did not train on the GPU"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """`vitp prep` over an ImageFolder of 3 classes (each tinted in its own colour channel, so a few
    steps learn something), 25% held out as val."""
    root = tmp_path_factory.mktemp("gpu_data")
    src, out = root / "images", root / "shards"
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            a = natural_image(rng, int(rng.integers(40, 72)), int(rng.integers(40, 72))).astype(np.int16)
            a[..., c] += 70
            (src / f"class{c}" / f"{i:03d}.jpg").write_bytes(jpeg_bytes(np.clip(a, 0, 255).astype(np.uint8)))
    r = _vitp("prep", str(src), str(out), "--val-fraction", "0.25", "--max-samples-per-shard", "24", "--seed", "0",
              "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads((out / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] + info["splits"]["val"]["num_samples"] == CLASSES * PER_CLASS
    return out


def _pretrain(run_dir: Path, data: Path, env: dict | None = None, *overrides: str) -> int:
    # DS_ACCELERATOR=cpu comes from tests/conftest.py: the stage must override it on a GPU node
    return run_local(["pretrain", "--config", TINY, f"run.dir={run_dir}", f"data.path={data}", *RUN, *overrides], 1,
                     env=env, timeout=600)


def test_nccl_zero2_bf16_kill_resume_and_eval(shards, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _pretrain(ref, shards) == 0
    want = _losses(ref)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in want.values()) and want[6] < want[1]
    _assert_trained_on_cuda(ref)

    # inline saves: step 4's checkpoint is published before the kill
    rc = _pretrain(run, shards, {"VITP_TEST_KILL_AT_STEP": "5", "VITP_TEST_KILL_RANK": "0"}, "checkpoint.async=false")
    assert rc != 0  # SIGKILLed before step 5
    assert sorted(_losses(run)) == [1, 2, 3, 4]
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-00000004"
    assert _pretrain(run, shards) == 0  # resumes from step 4
    steps = [r["step"] for r in _records(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # every step logged once, none repeated after the resume
    got = _losses(run)
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=BF16_REL), f"step {s}: resumed {got[s]} vs uninterrupted {want[s]}"
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-00000006"
    assert (run / "model.safetensors").is_file()

    r = _vitp("eval", "--checkpoint", str(run), "--data", str(shards), "--split", "val", "--batch", "16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((run / "results.json").read_text())
    n_val = json.loads((shards / "_info.json").read_text())["splits"]["val"]["num_samples"]
    assert results["eval/val/n"] == n_val
    top1 = results["eval/val/top1"]
    assert 0.0 <= top1 <= 1.0
    printed = [line.split() for line in r.stdout.splitlines() if line.startswith("val/top1")]
    assert printed and float(printed[0][1]) == pytest.approx(top1, abs=1e-4)


def test_submit_local_trains_on_the_gpu_despite_the_submitters_ds_accelerator(shards, tmp_path):
    run, jobs = tmp_path / "run", tmp_path / "jobs"
    # engine.backend=auto and a GPU asked for: the node decides (cuda, nccl); the submitter's
    # DS_ACCELERATOR=cpu reaches the job's environment and must not win
    r = _vitp("submit", "pretrain", "--config", TINY, "--cluster", "local", "--wait", f"run.dir={run}",
              f"data.path={shards}", f"cluster.log_dir={jobs}", *GPU, "engine.backend=auto", "cluster.nodes=1",
              "cluster.gpus_per_node=1", "train.steps=4", "train.log_every=2", "checkpoint.every=0",
              "train.compile=true",
              env=_env(DS_ACCELERATOR="cpu"), timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.startswith("job ")
    job_id = r.stdout.split()[1]
    result = json.loads((jobs / job_id / "result.json").read_text())
    assert (result["status"], result["step"], result["world_size"]) == ("completed", 4, 1)
    assert [r["step"] for r in _records(run) if "loss" in r] == [2, 4]
    _assert_trained_on_cuda(run)
    log = "".join(p.read_text() for p in (jobs / job_id).glob("*_log.*"))
    assert "on cuda" in log, log[-2000:]
