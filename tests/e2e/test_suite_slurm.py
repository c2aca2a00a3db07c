"""`vitp submit suite` on the local two-node SLURM cluster: configs/suite/tiny.yaml (2 datasets x 2 lrs,
2 steps a cell, one task each) from the session's tiny pre-trained checkpoint. Per dataset an array of
grid cells and a final job that depends on it (afterany); a second submission while they run is
refused; the table is complete and each final trained on the lr its grid chose."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.jobs import read_index, wait
from tests.integration.test_suite import tiny_suite
from tests.unit.test_data_shards import write_dataset

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ), timeout=timeout)


def test_suite_on_slurm_array_then_dependent_final(slurm_cluster, tiny_reference, corpus_shards, tmp_path):
    b = tmp_path / "shapes_b"
    write_dataset(b, {"train": [15, 15], "test": [9]}, num_classes=2)
    spec = tiny_suite(tmp_path, {"shapes_a": corpus_shards, "shapes_b": b}, {"shapes_a": "val"})
    out, jobs = tmp_path / "out", tmp_path / "jobs"
    args = ["submit", "suite", "--config", str(spec), f"init.from={tiny_reference(2)}", f"run.dir={out}",
            f"cluster.log_dir={jobs}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    r = cli(args)
    assert r.returncode == 0, r.stdout + r.stderr
    again = cli(args)  # while the first one's jobs are queued or running
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert f"run.dir {out}: this suite's job" in again.stderr

    index = [e for e in read_index(str(jobs)) if e.get("suite") == str(out)]
    assert len(index) == 6  # 2 datasets x (2 array tasks + 1 final)
    for d in ("shapes_a", "shapes_b"):
        (final,) = [e for e in index if e.get("suite_final") == d]
        grid = [e for e in index if e["stage"] == "transfer" and e["run_dir"].startswith(str(out / d / "grid_"))]
        array = {e["job_id"].split("_")[0] for e in grid}
        assert len(grid) == 2 and len(array) == 1 and all("_" in e["job_id"] for e in grid)
        assert final["after"] == sorted(array)
    states = wait(index, timeout_s=900)
    assert set(states.values()) == {"COMPLETED"}, states

    with open(out / "suite.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["completed"] * 6
    for d in ("shapes_a", "shapes_b"):
        grid = [r for r in rows if r["dataset"] == d and r["phase"] == "grid"]
        (final,) = [r for r in rows if r["dataset"] == d and r["phase"] == "final"]
        best = min(grid, key=lambda r: (-float(r["minival_top1"]), float(r["lr"])))
        assert final["lr"] == best["lr"] and best["selected"] == "yes"
        split = "val" if d == "shapes_a" else "test"
        res = json.loads((Path(final["run_dir"]) / "results.json").read_text())
        assert float(final["test_top1"]) == pytest.approx(res[f"{split}/top1"])
        assert (Path(final["run_dir"]) / "model.safetensors").is_file()
        assert not any((Path(g["run_dir"]) / "checkpoints").exists() for g in grid)
    assert (out / "suite.md").read_text().splitlines()[-1].startswith("| **mean** | ")
