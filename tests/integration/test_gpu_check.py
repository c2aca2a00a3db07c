"""`python3 bench/gpu_check.py --smoke` (`make gpu-check GPU_CHECK_SMOKE=1`): every part of the GPU
machine's check, on this CPU at tiny sizes, over the wheels `bench/gpu_wheels.py` writes (downloaded from
the package registry, DeepSpeed built here; a rerun keeps them), with every process seeing only the
image's packages and those wheels; run as the GPU machine runs it, one python command, no make.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".gpu-wheels"
OUT_FILES = {"summary.json", "check.log", "tests_gpu.xml", "syncs.txt", "syncs_trace.json.gz", "pretrain_metrics.jsonl"}


@pytest.fixture(scope="module")
def wheels() -> Path:
    r = subprocess.run([sys.executable, "bench/gpu_wheels.py", "--out", str(WHEELS)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "with the tracked source" in r.stderr and "of 64" in r.stderr  # the 64 MiB a GPU machine receives
    return WHEELS


def ratios(stdout: str) -> dict[str, float]:
    lines = stdout.splitlines()
    assert all(line.startswith("ratio ") and len(line.split()) == 3 for line in lines), stdout  # nothing else
    return {line.split()[1]: float(line.split()[2]) for line in lines}


def test_smoke_runs_every_part_on_the_cpu(wheels, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--wheels", str(wheels), "--out", str(out),
                        "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {k: p["status"] for k, p in summary["parts"].items()} == dict.fromkeys(
        ["install", "syncs", "tests_gpu", "pretrain", "gpu_step"], "ok")
    assert list(summary["parts"]) == ["install", "syncs", "tests_gpu", "pretrain", "gpu_step"]  # syncs first
    assert "every requirement met" in summary["parts"]["install"]["note"]

    got = ratios(r.stdout)
    n_gpu_tests = sum(1 for p in (ROOT / "tests/gpu").glob("test_*.py") for line in p.read_text().splitlines()
                      if line.startswith("def test_"))
    assert (got["gpu_tests_passed"], got["gpu_tests_failed"], got["gpu_tests_skipped"]) == (0, 0, n_gpu_tests)
    # no CUDA: no CUDA sync or copy in the trace, but the loop's own scalar reads are seen and placed
    assert got["plain_step_syncs_gpu"] == got["plain_step_event_syncs_gpu"] == got["plain_step_dtoh_copies_gpu"] == 0
    assert got["plain_step_pageable_htod_gpu"] == 0
    assert got["plain_step_scalar_reads_gpu"] >= 1
    assert "pipeline/" in (out / "syncs.txt").read_text() or "deepspeed/" in (out / "syncs.txt").read_text()
    # against an H100's peak a CPU's MFU is ~1e-7: measured (the records), though the 4-decimal line shows 0
    assert 0 <= got["mfu_pretrain_vit_b16_gpu"] < 1 and 0 <= got["mfu_vit_b16"] < 1
    wait = got["data_wait_pretrain_vit_b16_gpu"]
    assert math.isnan(wait) or 0 <= wait <= 1

    records = [json.loads(x) for x in (out / "pretrain_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "mfu" in r] == [2, 4, 6]
    assert all(r["mfu"] > 0 for r in records if "mfu" in r)
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert set(files) == OUT_FILES and all(size < 16 * 2**20 for size in files.values())


def test_a_failing_part_is_reported_and_the_next_one_runs(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--wheels", str(empty), "--out",
                        str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--parts", "install,tests_gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    parts = json.loads((tmp_path / "out/summary.json").read_text())["parts"]
    assert parts["install"]["status"] == "failed" and "make gpu-wheels" in parts["install"]["note"]
    assert parts["tests_gpu"]["status"] == "ok"
    assert "ratio gpu_tests_skipped" in r.stdout
    assert "[gpu-check] install   failed" in r.stderr


def test_the_image_guard_refuses_what_the_image_lacks():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench" / "gpu_image"), "VITP_IMAGE_DENY": "mlflow,moto"}
    code = "import yaml\ntry:\n    import mlflow.tracking\nexcept ModuleNotFoundError as e:\n    print(e)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "No module named 'mlflow' (not in the GPU image" in r.stdout


@pytest.fixture
def unremovable(tmp_path):
    """A result folder that cannot itself be removed, as a GPU machine's mounted one: a tmpfs mount point
    where this process may mount (root), else a folder in a read-only parent."""
    parent = tmp_path / "parent"
    out = parent / "out"
    out.mkdir(parents=True)
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "vitp-check", str(out)], check=True)
        try:
            yield out
        finally:
            subprocess.run(["umount", str(out)], check=True)
    else:
        parent.chmod(0o555)
        try:
            yield out
        finally:
            parent.chmod(0o755)


def test_the_output_folder_is_emptied_not_removed(unremovable, tmp_path):
    """The check clears its output folder's contents (a stale file, a stale folder) and writes its files
    there; removing the folder itself would fail on a mount point."""
    out = unremovable
    (out / "stale.txt").write_text("from the last run")
    (out / "old").mkdir()
    (out / "old" / "trace.json").write_text("{}")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--wheels", str(empty), "--out", str(out),
                        "--work", str(tmp_path / "work"), "--parts", "install"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]  # no wheels: the install part fails, reported
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "summary.json"], r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["parts"]["install"]["status"] == "failed"
