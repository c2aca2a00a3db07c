"""The GPU checks' CPU-testable parts: when a skip in tests/gpu/ is a failure, and bench/gpu_step.py's
arguments and the recipe step it measures (micro batch, accumulation on the planned cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import load_config
from tests.gpu.conftest import gpus_required

ROOT = Path(__file__).resolve().parents[2]


def test_a_skip_fails_only_where_gpus_were_asked_for():
    no_gpu, gpu = (lambda: False), (lambda: True)
    assert gpus_required({}, no_gpu) is None
    assert gpus_required({"CI": "true"}, no_gpu) is None  # CI's CPU runners skip
    assert gpus_required({"CI": "true"}, gpu) == "CI on a machine whose nvidia-smi lists a GPU"
    assert gpus_required({"VITP_REQUIRE_GPU": "1"}, no_gpu) == "VITP_REQUIRE_GPU is set"
    assert gpus_required({"VITP_REQUIRE_GPU": "0"}, gpu) is None


def test_gpu_tests_skip_in_one_line_without_cuda_and_fail_when_required():
    """Every test in tests/gpu/ (5: 2 in test_gpu_training.py, 3 in test_gpu_zero3_binding.py)."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-rs"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    from pipeline.distributed import cuda_problem

    if cuda_problem() is not None:
        assert r.returncode == 0 and "5 skipped" in r.stdout, r.stdout[-2000:]
        skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
        assert skips and all(f"needs a CUDA GPU: {cuda_problem()}" in line for line in skips), r.stdout[-2000:]
        assert "\n" not in cuda_problem()  # the reason is one line
        env = {**os.environ, "VITP_REQUIRE_GPU": "1"}
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 1 and "VITP_REQUIRE_GPU is set" in r.stdout and "5 error" in r.stdout, r.stdout[-2000:]


def test_bench_gpu_step_help_and_recipe_step():
    r = subprocess.run([sys.executable, "bench/gpu_step.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "zero1_vs_zero2_gpu" in r.stdout and "--accum" in r.stdout
    assert "--resources" in r.stdout and "mfu_vit_l16_recipe" in r.stdout
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_step
    finally:
        sys.path.remove(str(ROOT / "bench"))
    res = str(ROOT / "configs/cluster/h100_8x.yaml")
    for name in ("vit_l16", "vit_h14"):
        cfg = load_config(ROOT / f"configs/pretrain/{name}.yaml", [], resources=res, world_size=1)
        mb, accum, zero, ckpt = gpu_step.recipe_step(name, res)
        assert (mb, zero, ckpt) == (cfg.train.micro_batch, cfg.engine.zero_stage, cfg.model.grad_checkpointing)
        assert mb * accum * cfg.cluster.nodes * 8 == cfg.train.global_batch  # 8 GPUs per node in h100_8x.yaml


def test_bench_gpu_step_smoke_prints_every_ratio_and_a_slow_loaders_wait():
    """bench/gpu_step.py --smoke (every section on the CPU, one model) with the loader held 0.25 s per
    batch at the loop's seam: its fed step reports that wait as data_wait; uncompiled on a CPU, the
    compiled and uncompiled timm comparisons are one and the same pair."""
    env = {**os.environ, "VITP_TEST_SLOW_BATCH_S": "0.25"}
    r = subprocess.run([sys.executable, "bench/gpu_step.py", "--smoke", "--models", "vit_b16"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {name: float(v) for _, name, v in (line.split() for line in r.stdout.splitlines())}
    assert list(got) == ["mfu_vit_b16", "step_vs_timm_gpu", "step_vs_timm_gpu_eager", "step_vs_timm_gpu_token0",
                         "zero2_vs_plain_gpu", "loader_vs_step_gpu", "data_wait_vit_b16_gpu",
                         "plan_vs_measured_mem_gpu", "mfu_vit_b16_recipe", "zero1_vs_zero2_gpu"], r.stdout
    assert got["step_vs_timm_gpu_eager"] == got["step_vs_timm_gpu"] > 0
    # 0.25 s waited per step of a tiny model (tens of ms here): most of the wall time
    assert 0.5 < got["data_wait_vit_b16_gpu"] < 1.0, r.stderr[-3000:]
