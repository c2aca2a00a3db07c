"""Every tensor vitp hands to a collective lives on the group's device, and the accelerator is the
training node's own choice.

A GPU run's group is NCCL, which rejects host tensors ("No backend type associated with device type
cpu") at the first step; gloo on a CPU test accepts them, so a host tensor would pass every CPU test.
Here the group's device is `meta` (playing the GPU's part) while the code computes wherever it is
told: the loop's and the eval loop's collective call sites run on `meta`, and any tensor that
reaches `pipeline.distributed.all_reduce` from the host fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipeline.distributed as pd
from pipeline.distributed import DistEnv
from pipeline.network import free_port

ROOT = Path(__file__).resolve().parents[2]
META = torch.device("meta")


@pytest.fixture
def meta_group(monkeypatch):
    """A 1-rank gloo group whose collectives are declared to run on `meta`; records every tensor
    that reaches all_reduce and hands back a host stand-in so the caller can read a result."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    monkeypatch.setattr(pd, "_COMM_DEVICE", META)
    seen: list[torch.device] = []
    real = pd.all_reduce

    def recording(t, op="sum"):
        real(t, op)  # the device check itself; raises on a host tensor
        seen.append(t.device)
        return torch.zeros(t.shape, dtype=t.dtype)  # what a reduced copy would read back as

    yield seen, recording
    dist.destroy_process_group()


def test_all_reduce_refuses_a_host_tensor_when_the_group_is_elsewhere(meta_group):
    with pytest.raises(RuntimeError, match="collective on a cpu tensor, but the group's device is meta"):
        pd.all_reduce(torch.zeros(2))
    t = torch.zeros(2, device=META)
    assert pd.all_reduce(t, "max") is t


def test_training_loop_agreement_and_window_stay_on_the_device(meta_group, monkeypatch):
    from pipeline.train import loop, periodic

    seen, recording = meta_group
    monkeypatch.setattr(loop, "all_reduce", recording)
    monkeypatch.setattr(periodic, "all_reduce", recording)
    window, agree = periodic.Window(META), loop.Agreement(META)
    step_sums = torch.zeros(3, dtype=torch.float64, device=META)
    window.add(step_sums)
    norm_bad = torch.zeros((), device=META)
    agree.post(1, "requeue", step_sums[0], norm_bad)
    agree.post(2, None, step_sums[0], norm_bad)
    assert agree.read(lag=True) == (0.0, None, False)  # the host stand-in reads back zeros
    assert len(agree.pending) == 1 and agree.pending[0][0] == 2
    assert agree.settle(2, norm_bad) == (0.0, None, False) and agree.pending == []
    assert window.reduce(0.25) == (0.0, 0.0, 0, 0.0) and window.steps == 0
    assert seen == [META] * 4


def test_eval_loop_collectives_stay_on_the_device(meta_group, monkeypatch):
    from pipeline.eval import loop as cl
    from pipeline.model import build_vit

    seen, recording = meta_group
    monkeypatch.setattr(cl, "all_reduce", recording)
    monkeypatch.setattr(cl, "_is_dist", lambda: True)  # take the multi-rank path on one rank
    model = build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3).to(META)
    batches = [(torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8), torch.tensor([0, 1, 2, 0]),
                torch.tensor([True, True, True, False]))] * 2
    res = cl.classify(model, batches, 3, device=META, prepare=lambda x: x.float() / 255,
                      dummy_shape=(1, 3, 8, 8))
    assert res.n == 0  # the stand-in's zeros: what matters is where the tensors were
    assert seen == [META] * 4  # batch count, counts, sums, elapsed


def test_labels_are_checked_on_the_host_before_any_copy():
    from pipeline.eval.loop import classify
    from pipeline.model import build_vit

    model = build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3)
    bad = [(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 7]), torch.tensor([True, True]))]
    with pytest.raises(ValueError, match="label 7 out of range for 3 classes"):
        classify(model, bad, 3, prepare=lambda x: x.float())
    padded = [(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([1, -1]), torch.tensor([True, False]))]
    assert classify(model, padded, 3, prepare=lambda x: x.float()).n == 1  # padding is no sample


def test_asking_for_gpus_without_cuda_fails_in_one_line_naming_why(tmp_path):
    """engine.backend=nccl on a node where CUDA is unusable: exit 2 before anything trains."""
    if torch.cuda.is_available():
        pytest.skip("needs a node where CUDA is not usable; tests/gpu runs the GPU side")
    env = dict(os.environ, DS_ACCELERATOR="cuda", PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "-m", "launch.cli", "pretrain", "--config", "configs/pretrain/tiny_cpu.yaml",
                        "data.path=synthetic:train=64,val=16", f"run.dir={tmp_path / 'run'}", "engine.backend=nccl",
                        "train.steps=1", "tracking.enabled=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: engine.backend=nccl asks for GPUs but CUDA is not usable: torch ")
    assert "built for CUDA" in line or "CPU-only build" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_accelerator_is_chosen_here_and_overrides_the_submitters(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU node's choice; tests/gpu covers the GPU one")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # as sbatch would carry it from a GPU login node
    assert pd.choose_accelerator("auto", 0) == "cpu" and os.environ["DS_ACCELERATOR"] == "cpu"
    with pytest.raises(pd.AcceleratorError, match="cluster.gpus_per_node=8 asks for GPUs"):
        pd.choose_accelerator("auto", 8)


def test_device_index_follows_per_task_binding(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1: one visible GPU
    assert pd.local_device_index(DistEnv(rank=5, world_size=8, local_rank=5, local_world_size=8)) == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # the whole node visible
    assert pd.local_device_index(DistEnv(rank=13, world_size=16, local_rank=5, local_world_size=8)) == 5
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(pd.AcceleratorError, match="local rank 5 but only 4 GPUs visible"):
        pd.local_device_index(DistEnv(rank=5, world_size=8, local_rank=5, local_world_size=8))
