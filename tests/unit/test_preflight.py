"""`vitp preflight`'s parts a CPU can show: NVIDIA's driver table and the one-line refusal, nvidia-smi
read through PATH, the bus-bandwidth formula, the GPU-binding judgement (fake device counts), the
table and its verdict, run.dir and shard throughput on real files, and the command's arguments.
The whole job on the local SLURM cluster is tests/e2e/test_preflight_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.preflight_job import DEFAULTS, DriverMismatch, check_driver, preflight_job, probe_command
from pipeline.config import load_config
from pipeline.driver import MIN_DRIVER, driver_problem, min_driver, node_driver, parse_version
from pipeline.preflight import (
    FAIL,
    OK,
    SKIP,
    Row,
    binding_rows,
    bus_bandwidth,
    checkpoint_bytes,
    fabric_gbps,
    format_table,
    judge,
    read_throughput,
    remove_probe,
    verdict,
    write_throughput,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/pretrain/tiny_cpu.yaml"


def fake_nvidia_smi(folder: Path, version: str) -> str:
    """A directory holding an `nvidia-smi` that prints ``version``; returns a PATH with it first."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


# ------------------------------------------------------------------------------------------ driver table
def test_min_driver_table_is_nvidias():
    assert MIN_DRIVER == {11: (450, 80, 2), 12: (525, 60, 13), 13: (580,)}
    assert min_driver("12.8") == (525, 60, 13) and min_driver("13.0") == (580,) and min_driver("10.2") is None
    assert parse_version("535.104.05") == (535, 104, 5)
    with pytest.raises(ValueError):
        parse_version("R535")


@pytest.mark.parametrize("cuda, driver, ok", [
    ("13.0", "535.104.05", False), ("13.0", "580.65.06", True), ("13.1", "580.0", True),
    ("12.4", "525.60.13", True), ("12.4", "525.60.12", False), ("12.1", "570.86.10", True),
    ("11.8", "450.80.02", True), ("11.8", "440.33", False),
])
def test_driver_problem_names_both_versions(cuda, driver, ok):
    line = driver_problem(cuda, driver, where="node7")
    assert (line is None) == ok
    if not ok:
        assert f"CUDA {cuda}" in line and f"driver {driver}" in line and "node7" in line and "\n" not in line


def test_driver_problem_without_driver_or_cuda():
    assert "no NVIDIA driver" in driver_problem("13.0", None, "node1")
    assert "CPU-only" in driver_problem(None, "580.1")


def test_node_driver_reads_nvidia_smi_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", "535.104.05"))
    assert node_driver() == "535.104.05"


def test_driver_probe_module_prints_json(tmp_path):
    env = {**os.environ, "PATH": fake_nvidia_smi(tmp_path / "bin", "550.54.15"), "VITP_TEST_TORCH_CUDA": "13.0",
           "SLURMD_NODENAME": "gpu07"}
    r = subprocess.run([sys.executable, "-m", "pipeline.driver"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    import json

    got = json.loads(r.stdout)
    assert (got["host"], got["torch_cuda"], got["driver"]) == ("gpu07", "13.0", "550.54.15")
    assert "needs an NVIDIA driver >= 580" in got["problem"] and "gpu07 has driver 550.54.15" in got["problem"]


def _cfg(*over: str):
    return load_config(TINY, ["data.path=synthetic:classes=4,train=64,val=8", *over], world_size=2)


def test_check_driver_refuses_a_gpu_job_on_an_old_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", "535.104.05"))
    monkeypatch.setenv("VITP_TEST_TORCH_CUDA", "13.0")
    with pytest.raises(DriverMismatch, match=r"CUDA 13\.0, which needs an NVIDIA driver >= 580, but .* has driver "
                                             r"535\.104\.05"):
        check_driver(_cfg("engine.backend=nccl"), "local")
    check_driver(_cfg(), "local")  # a CPU job (gloo, no GPUs) asks nothing
    monkeypatch.setenv("VITP_TEST_TORCH_CUDA", "12.4")  # minor-version compatibility: 12.x runs on 525+
    check_driver(_cfg("engine.backend=nccl"), "local")


def test_probe_command_asks_the_partition_for_no_gpu():
    cfg = _cfg("cluster.partition=gpu", "cluster.account=vision", "cluster.gpus_per_node=2")
    cmd = probe_command(cfg)
    assert cmd[:3] == ["srun", "-N1", "-n1"] and "--partition=gpu" in cmd and "--account=vision" in cmd
    assert not any("gpu" in c and c.startswith(("--gpus", "--gres")) for c in cmd)
    assert cmd[-3:] == [sys.executable, "-m", "pipeline.driver"]


def test_preflight_job_keeps_resources_and_runs_over_gloo():
    cfg = _cfg("cluster.gpus_per_node=2", "cluster.time_min=2880", "engine.backend=auto")
    job_cfg, call = preflight_job(cfg, {**DEFAULTS, "time_min": 7})
    assert (job_cfg.cluster.gpus_per_node, job_cfg.cluster.time_min) == (2, 7)  # the allocation asks for the GPUs
    assert job_cfg.cluster.job_name.endswith("-preflight") and cfg.cluster.time_min == 2880
    assert (call.cfg["engine"]["backend"], call.cfg["cluster"]["gpus_per_node"]) == ("gloo", 0)  # the tasks' group
    assert call.kwargs["want_gpus"] and call.kwargs["want_nccl"] and call.target == "pipeline.preflight:preflight"


# ------------------------------------------------------------------------------------------ measurements
def test_bus_bandwidth_is_nccl_tests_formula():
    # 1 GB in 0.1 s over 8 ranks: algbw 10 GB/s, busbw 10 x 2 x 7/8 = 17.5 GB/s
    assert bus_bandwidth(1e9, 0.1, 8) == pytest.approx(17.5)
    assert bus_bandwidth(1e9, 0.1, 2) == pytest.approx(10.0)
    assert bus_bandwidth(1e9, 0.1, 1) == 0.0


def test_fabric_and_checkpoint_size():
    hw = SimpleNamespace(inter_node_gbps=50.0, intra_node_gbps=450.0, nics_per_node=8)
    assert fabric_gbps(hw, 4) == (400.0, "vitp plan's bus 400 GB/s (the slower of hardware.nics_per_node 8 x "
                                         "inter_node_gbps 50 and intra_node_gbps 450)")
    assert fabric_gbps(hw, 1) == (450.0, "vitp plan's bus 450 GB/s (hardware.intra_node_gbps, NVLink)")
    assert fabric_gbps(SimpleNamespace(inter_node_gbps=50.0, intra_node_gbps=300.0, nics_per_node=8), 2)[0] == 300
    assert checkpoint_bytes(1_000, "bf16") == 14_000 and checkpoint_bytes(1_000, "fp32") == 12_000


def _rep(rank, host, count, device, lr=None, uuid=None, visible=None):
    return {"rank": rank, "host": host, "local_rank": rank % 2, "env_local_rank": rank % 2 if lr is None else lr,
            "count": count, "device": device, "uuid": uuid, "visible": visible}


def test_binding_per_task_gpu_with_local_rank_beyond_it_fails():
    # --gpus-per-task=1: each task sees one GPU (device 0) but LOCAL_RANK stays 0/1
    reps = [_rep(0, "n1", 1, 0, uuid="GPU-a", visible="0"), _rep(1, "n1", 1, 0, uuid="GPU-b", visible="1")]
    (row,) = binding_rows(reps, want_gpus=True)
    assert row.status == FAIL and "LOCAL_RANK=1 but 1 GPU(s) visible" in row.value and "cuda:1" in row.value
    reps[1]["env_local_rank"] = 0  # a launcher that keeps LOCAL_RANK and the device consistent
    assert binding_rows(reps, want_gpus=True)[0].status == OK


def test_binding_two_ranks_on_one_gpu_and_no_gpu():
    same = [_rep(0, "n1", 2, 0, uuid="GPU-a"), _rep(1, "n1", 2, 0, uuid="GPU-a", lr=1)]
    assert "ranks 0 and 1 share one GPU (GPU-a)" in binding_rows(same, True)[0].value
    rows = binding_rows([_rep(0, "n1", 2, 0, uuid="A"), _rep(1, "n1", 2, 1, uuid="B"), _rep(2, "n2", 0, None)], True)
    assert [r.status for r in rows] == [OK, FAIL] and "rank 2 sees no GPU" in rows[1].value
    assert [r.status for r in binding_rows([_rep(0, "n1", 0, None)], want_gpus=False)] == [SKIP]


def test_table_and_verdict():
    rows = [Row("driver", "node1", OK, "torch CUDA 12.4, driver 550.54.15", "driver >= 525.60.13"),
            Row("shards read", "node2", FAIL, "40 MB/s (3 shards, 120.0 MB)", ">= 90.0 MB/s"),
            Row("run.dir write", "node2", FAIL, "run.dir /x: not writable")]
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["check", "node", "status", "measured"] and len(lines) == 5
    assert lines[3].startswith("shards read    node2  FAIL")
    ok, line = verdict(rows)
    assert not ok and line == ("preflight FAILED: shards read on node2: 40 MB/s (3 shards, 120.0 MB); "
                               "needs >= 90.0 MB/s (+1 more failed)")
    assert verdict(rows[:1]) == (True, "preflight PASSED: 1 checks on 1 node(s)")


def test_judge_compares_with_the_plan_and_the_fabric():
    cfg = _cfg("engine.backend=nccl", "engine.precision=bf16", "cluster.nodes=2", "cluster.tasks_per_node=1",
               "cluster.signal_delay_s=10")
    node = {"torch_cuda": "12.4", "driver": "550.54.15", "io": {"mb_s": 100.0, "bytes": 1 << 20},
            "read": {"mb_s": 50.0, "bytes": 5e7, "shards": 2, "sample_bytes": 100_000.0}}
    reps = [{**_rep(r, f"node{r + 1}", 1, 0, lr=0, uuid=f"G{r}"), "node": node, "route": "10.0.0.1", "ifname": None}
            for r in range(2)]
    coll = {"gloo_sum_ok": True, "gloo_s": 0.01, "bytes": 1 << 26, "side_s": 0.001, "nccl_s": 0.004}
    # 1000 img/s for the job: 500 per node x 100 kB = 50 MB/s needed; checkpoint 1e8 x 14 B / 2 nodes at 100 MB/s = 7 s
    rows = judge(cfg, reps, coll, want_gpus=True, want_nccl=True, min_fabric=0.5,
                 plan={"images_per_s": 1000.0, "params": 100_000_000})
    by = {(r.check, r.where): r for r in rows}
    assert by[("driver", "node1")].status == OK and by[("shards read", "node2")].status == OK
    assert by[("shards read", "node2")].need.startswith(">= 50.0 MB/s: 500 img/s per node (vitp plan) x 100.0 kB")
    assert by[("run.dir write", "node1")].status == OK and "in 7.0 s" in by[("run.dir write", "node1")].need
    nccl = by[("nccl", "all")]  # 64 MiB in 4 ms over 2 ranks: 16.8 GB/s bus < 0.5 x (8 NICs x 50 GB/s)
    assert nccl.status == FAIL and "bus 16.8 GB/s" in nccl.value
    assert nccl.need == (">= 0.5 x vitp plan's bus 400 GB/s (the slower of hardware.nics_per_node 8 x "
                         "inter_node_gbps 50 and intra_node_gbps 450)")
    slow = judge(cfg, reps, coll, want_gpus=True, want_nccl=True, min_fabric=0.04,
                 plan={"images_per_s": 2000.0, "params": 200_000_000})
    by = {(r.check, r.where): r for r in slow}
    assert by[("nccl", "all")].status == OK
    assert by[("shards read", "node1")].status == FAIL and by[("run.dir write", "node1")].status == FAIL


def test_write_throughput_real_fsync_and_unwritable(tmp_path):
    got = write_throughput(str(tmp_path / "run"), 2, "n1-0")
    assert got["bytes"] == 2 << 20 and got["mb_s"] > 0
    assert list((tmp_path / "run").rglob("*")) == [tmp_path / "run" / ".preflight"]  # its file is gone
    (tmp_path / "kept").mkdir()
    write_throughput(str(tmp_path / "kept"), 1, "n1-0")
    remove_probe(str(tmp_path / "kept"), made=False)  # rank 0, after every node wrote
    remove_probe(str(tmp_path / "run"), made=True)
    assert not (tmp_path / "run").exists() and list((tmp_path / "kept").iterdir()) == []
    (tmp_path / "afile").write_text("x")
    bad = write_throughput(str(tmp_path / "afile" / "run"), 2, "n1-0")
    assert bad["error"].startswith(f"run.dir {tmp_path}/afile/run: not writable (NotADirectoryError")


def test_read_throughput_over_real_shards(corpus_shards, tmp_path):
    info = json.loads((corpus_shards / "_info.json").read_text())  # the session's `vitp prep` output
    files = [corpus_shards / f for f in info["splits"]["train"]["filenames"]]
    assert len(files) >= 2  # the read spans shards
    total = sum(f.stat().st_size for f in files)
    got = read_throughput(str(corpus_shards), "train", 1, budget_mb=64)
    assert got["bytes"] == total and got["shards"] == len(files) and got["mb_s"] > 0
    assert got["sample_bytes"] == pytest.approx(total / info["splits"]["train"]["num_samples"])
    assert "not found" in read_throughput(str(tmp_path / "nope"), "train", 0, 64)["error"]
    assert "skip" in read_throughput("synthetic:classes=2,train=8", "train", 0, 64)


# ------------------------------------------------------------------------------------------ the command
def test_preflight_help_and_bad_arguments():
    run = lambda *a: subprocess.run([sys.executable, "-m", "launch.cli", "preflight", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("--help")
    assert r.returncode == 0 and "example:\n  vitp preflight --config" in r.stdout and "--io-mb" in r.stdout
    r = run("--config", str(TINY), "data.path=synthetic:classes=2,train=8", "--min-fabric", "2", "--cluster", "local")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --io-mb >= 1")
    r = run("--config", str(TINY), "data.path=/nonexistent/shards", "--cluster", "local")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "/nonexistent/shards" in r.stderr
