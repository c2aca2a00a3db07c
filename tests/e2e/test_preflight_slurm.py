"""`vitp preflight` and `vitp submit --preflight` on the real local SLURM cluster (2 nodes x 1 task,
gloo on CPU) over shards written by `vitp prep`: the table with measured numbers, a failed check in
one line (run.dir not writable, an old NVIDIA driver), the real job queued only after a pass, and
`vitp submit` refusing a GPU job on an old driver before sbatch.

The only fakes are the two things a CPU machine cannot have: the node's driver (an `nvidia-smi` on the
jobs' PATH printing an old version; srun and sbatch export the submitter's PATH) and, where a test
says so, torch's CUDA build (VITP_TEST_TORCH_CUDA).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.jobs import read_index
from tests.unit.test_preflight import fake_nvidia_smi

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/pretrain/tiny_cpu.yaml"
RES = "configs/cluster/local_debug.yaml"
SMALL = ["--io-mb", "16", "--allreduce-mb", "4", "--time-min", "5"]
CPU_RATE = "hardware.peak_tflops=0.05"  # this CPU's order of magnitude: the plan's step rate, and what it needs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def shards(corpus_shards) -> Path:
    """Real shards from `vitp prep` (tests/conftest.py, shared with the submit tests)."""
    return corpus_shards


def vitp(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """The table: (check, node) -> [status, measured + needs]."""
    out, checks = {}, r"(driver|gpus|all-reduce|nccl|side group|run\.dir write|shards read)"
    for line in stdout.splitlines():
        m = re.match(checks + r"\s+(\S+)\s+(\S+)\s+(.*)", line)
        if m:
            out[(m[1], m[2])] = [m[3], m[4]]
    return out


def test_preflight_passes_on_two_nodes_with_numbers(cluster_up, shards, tmp_path):
    r = vitp("preflight", "--config", TINY, "--resources", RES, f"data.path={shards}", f"run.dir={tmp_path / 'run'}",
             f"cluster.log_dir={tmp_path / 'jobs'}", CPU_RATE, *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    t = rows(r.stdout)
    for node in ("node1", "node2"):
        assert t[("driver", node)][0] == "skip" and t[("gpus", node)][0] == "skip"  # a CPU run asks for no GPU
        status, text = t[("run.dir write", node)]
        assert status == "ok" and float(re.search(r"(\d+) MB/s \(16 MiB \+ fsync\)", text)[1]) > 0
        status, text = t[("shards read", node)]
        have, need = (float(x) for x in re.search(r"(\d+) MB/s \(\d+ shards.*>= ([\d.]+) MB/s", text).groups())
        assert status == "ok" and have >= need > 0
    status, text = t[("all-reduce", "all")]
    assert status == "ok" and float(re.search(r"gloo 4 MiB x 2 ranks: bus ([\d.]+) GB/s", text)[1]) > 0
    assert t[("side group", "all")][0] == "ok" and "node1 via" in t[("side group", "all")][1]
    assert r.stdout.strip().splitlines()[-1] == "preflight PASSED: 10 checks on 2 node(s)"
    assert not (tmp_path / "run").exists()  # nothing left behind in the run dir it made
    assert [e["stage"] for e in read_index(tmp_path / "jobs")] == ["preflight"]


def test_preflight_failures_are_one_line(cluster_up, shards, tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    r = vitp("preflight", "--config", TINY, "--resources", RES, f"data.path={shards}",
             f"run.dir={tmp_path / 'afile' / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", CPU_RATE, *SMALL)
    assert r.returncode == 1, r.stdout + r.stderr
    t = rows(r.stdout)
    assert [t[("run.dir write", n)][0] for n in ("node1", "node2")] == ["FAIL", "FAIL"], r.stdout
    others = sum(v[0] == "FAIL" for v in t.values()) - 1  # the line names the first and counts the rest
    assert r.stderr.strip().splitlines()[-1] == (
        f"preflight FAILED: run.dir write on node1: run.dir {tmp_path}/afile/run: not writable (NotADirectoryError: "
        f"Not a directory) (+{others} more failed)"), r.stdout
    # a missing data path: one line, exit 2, nothing queued
    r = vitp("preflight", "--config", TINY, "--resources", RES, f"data.path={tmp_path / 'none'}",
             f"cluster.log_dir={tmp_path / 'jobs2'}", *SMALL)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(tmp_path / "none") in r.stderr
    assert read_index(tmp_path / "jobs2") == []


def test_submit_preflight_old_driver_submits_nothing(cluster_up, shards, tmp_path):
    """torch's CUDA 13.0 (faked: this CPU torch may be any build) on nodes whose driver is 535."""
    env = {"PATH": fake_nvidia_smi(tmp_path / "bin", "535.104.05"), "VITP_TEST_TORCH_CUDA": "13.0"}
    r = vitp("submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={shards}",
             f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={tmp_path / 'jobs'}", "engine.backend=nccl", CPU_RATE,
             "--preflight", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert err[-2].startswith("preflight FAILED: driver on node1: torch is built for CUDA 13.0, which needs an NVIDIA "
                              "driver >= 580, but node1 has driver 535.104.05")
    assert err[-1].startswith("not submitted: the preflight failed")
    assert rows(r.stdout)[("driver", "node2")][0] == "FAIL"
    assert [e["stage"] for e in read_index(tmp_path / "jobs")] == ["preflight"]  # the real job was never queued


def test_submit_preflight_pass_then_submits(cluster_up, shards, tmp_path):
    jobs = tmp_path / "jobs"
    r = vitp("submit", "pretrain", "--config", TINY, "--resources", RES, f"data.path={shards}", "train.steps=2",
             f"run.dir={tmp_path / 'run'}", f"cluster.log_dir={jobs}", "tracking.enabled=false", CPU_RATE,
             "--preflight")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("preflight job ") and "preflight PASSED: 10 checks on 2 node(s)" in lines
    assert lines[-1].startswith("job ") and lines.index("preflight PASSED: 10 checks on 2 node(s)") < len(lines) - 1
    index = read_index(jobs)
    assert [e["stage"] for e in index] == ["preflight", "pretrain"] and index[1]["job_id"] == lines[-1].split()[1]
    subprocess.run(["scancel", index[1]["job_id"]], check=True, timeout=60)  # queued: that is all this test asks


def test_submit_refuses_a_gpu_job_on_an_old_driver(cluster_up, tmp_path):
    """The srun probe on the partition, before sbatch: one line naming both versions; a new driver passes."""
    base = ["submit", "pretrain", "--config", TINY, "--resources", RES, "data.path=synthetic:classes=4,train=64,val=8",
            f"cluster.log_dir={tmp_path / 'jobs'}", "engine.backend=nccl", "--dry-run"]
    old = {"PATH": fake_nvidia_smi(tmp_path / "old", "535.104.05"), "VITP_TEST_TORCH_CUDA": "13.0"}
    r = vitp(*base, env=old)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert re.match(r"error: torch is built for CUDA 13\.0, which needs an NVIDIA driver >= 580, but node[12] has "
                    r"driver 535\.104\.05: a GPU job would fail at start; not queued", line), line
    new = {"PATH": fake_nvidia_smi(tmp_path / "new", "580.65.06"), "VITP_TEST_TORCH_CUDA": "13.0"}
    r = vitp(*base, env=new)
    assert r.returncode == 0 and '"nodes": 2' in r.stdout, r.stdout + r.stderr
    assert read_index(tmp_path / "jobs") == []


@pytest.fixture
def cluster_up(request):
    return request.getfixturevalue("slurm_cluster")
