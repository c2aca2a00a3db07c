"""pipeline.distributed.setup: the one process setup of every stage (accelerator, rendezvous, group)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipeline.distributed as pd
from pipeline.config import EvalConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_rank(monkeypatch):
    """A launcher's environment for one rank; restored (and the group left) afterwards."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(pd.free_port()), "DS_ACCELERATOR": "cuda"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield
    pd.leave_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node where CUDA is not usable")
def test_setup_joins_once_and_keeps_the_first_choice(one_rank):
    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", world_size=1)
    assert pd.setup(cfg) == "cpu"
    assert os.environ["DS_ACCELERATOR"] == "cpu"  # decided here, not inherited from the submitting host
    group = dist.group.WORLD
    assert dist.is_initialized() and dist.get_world_size() == 1 and pd.comm_device() == torch.device("cpu")
    os.environ["LOCAL_RANK"] = "5"  # what bind_local_rank may have set: a second call must not undo it
    assert pd.setup(cfg) == "cpu" and dist.group.WORLD is group and os.environ["LOCAL_RANK"] == "5"
    pd.leave_process_group()
    assert not dist.is_initialized()
    os.environ["LOCAL_RANK"] = "0"
    assert pd.setup(load_config(None, ["data.path=x"], schema=EvalConfig)) == "cpu"  # the eval stage's config
    assert dist.is_initialized() and dist.group.WORLD is not group


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node where CUDA is not usable")
def test_a_job_that_asked_for_gpus_is_held_to_them(one_rank):
    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", world_size=1)
    with pytest.raises(pd.AcceleratorError, match=r"cluster.gpus_per_node=4 asks for GPUs but CUDA is not usable"):
        pd.setup(cfg, gpus_asked=4)
    assert not dist.is_initialized()


def test_a_ranks_threads_come_from_cpus_per_task_whatever_the_launcher_put_in_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's, for every rank it starts
    note = pd.use_cpu_threads(2)
    assert torch.get_num_threads() == 2  # the intra-op pool the training math runs on
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "2"  # for the rank's children
    assert note == ("note: 2 CPU thread(s) per rank from cluster.cpus_per_task (OMP_NUM_THREADS=1 from the "
                    "environment is not used: set cluster.cpus_per_task)")
    assert pd.use_cpu_threads(2) is None  # nothing to say when the environment agrees (a second setup)
    monkeypatch.delenv("OMP_NUM_THREADS")  # submitit's local executor, a SLURM task: nothing set
    assert pd.use_cpu_threads(1) is None and torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
