"""pipeline.distributed.setup: the one process setup of every stage (accelerator, rendezvous, group)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipeline.distributed as pd
from pipeline.config import EvalConfig, load_config
from pipeline.network import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_rank(monkeypatch):
    """A launcher's environment for one rank; restored (and the group left) afterwards."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cuda"}
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
    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", ["cluster.gpus_per_node=4"], world_size=1)
    with pytest.raises(pd.AcceleratorError, match=r"cluster.gpus_per_node=4 asks for GPUs but CUDA is not usable"):
        pd.setup(cfg)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node where CUDA is not usable")
@pytest.mark.parametrize("recipe, over, why, cpu", [
    ("pretrain/vit_b16.yaml", [], "cluster.gpus_per_node=8", "cluster.gpus_per_node=0"),
    ("transfer/vit_l16_384.yaml", ["engine.backend=nccl"], "engine.backend=nccl",
     "engine.backend=gloo cluster.gpus_per_node=0")])
def test_a_recipe_that_asks_for_gpus_fails_under_any_launcher(one_rank, recipe, over, why, cpu):
    """setup(cfg), as every stage calls it under torchrun or vitp's own launcher: the config's GPU
    request, not only a SLURM job's, and the line names the override that trains on the CPU."""
    cfg = load_config(ROOT / "configs" / recipe, ["data.path=x", *over], world_size=1)
    with pytest.raises(pd.AcceleratorError) as e:
        pd.setup(cfg)
    assert str(e.value).startswith(f"{why} asks for GPUs but CUDA is not usable: ")
    assert str(e.value).endswith(f"; to train on the CPU, override {cpu}") and "\n" not in str(e.value)
    assert not dist.is_initialized()
    assert pd.setup(load_config(ROOT / "configs" / recipe, ["data.path=x", *over, *cpu.split()], world_size=1)) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node where CUDA is not usable")
def test_the_stage_command_refuses_before_training(tmp_path):
    """`vitp pretrain` under a launcher's variables (torchrun's): exit 2, one line, the run dir untouched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "LOCAL_", "MASTER_", "SLURM_"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "launch.cli", "pretrain", "--config",
                        str(ROOT / "configs/pretrain/tiny_cpu.yaml"), "cluster.gpus_per_node=1",
                        "data.path=synthetic", "train.steps=1", "tracking.enabled=false", f"run.dir={tmp_path / 'r'}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert lines[-1].startswith("error: cluster.gpus_per_node=1 asks for GPUs but CUDA is not usable")
    assert lines[-1].endswith("override cluster.gpus_per_node=0") and not (tmp_path / "r").exists()


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


_FAULTS = """
import resource, sys, torch
from pipeline.threads import steady_allocator
applied = steady_allocator() if sys.argv[1] == "steady" else None
def step():  # a step's pattern: activations of 8 and 40 MiB made, used, freed
    a, b = torch.ones(2 * 2**20), torch.ones(10 * 2**20)
    return float(a[-1] + b[-1])
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("env", [{}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_a_ranks_allocator_keeps_what_a_step_frees_unless_the_user_set_it(env):
    """steady_allocator (setup calls it): the memory of a step's freed tensors is reused by the next
    step, without a page fault; glibc's default gives each 40 MiB tensor fresh, zero-filled pages
    (10k faults a step). A threshold the user set in the environment is kept."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    runs = {mode: subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, cwd=ROOT,
                                 env={**clean, **env, "PYTHONPATH": str(ROOT)}, timeout=120)
            for mode in ("steady", "default")}
    out = {mode: r.stdout.split() for mode, r in runs.items()}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr[-800:] for r in runs.values()]
    assert int(out["default"][1]) > 50_000, out  # glibc's default (and the users' settings here): fresh pages
    if env:
        assert out["steady"][0] == "False"  # the user's setting stays
    else:
        # at most one 40 MiB tensor's fresh pages in 10 steps (the heap grown once more), not one a step
        assert out["steady"][0] == "True" and int(out["steady"][1]) < 15_000, out


def test_a_free_port_is_one_no_outgoing_connection_can_be_handed_meanwhile():
    """The local launcher picks the port and the ranks bind it later: a port of the kernel's ephemeral
    range could be given to any connection in between (it was, once, under the full suite)."""
    import random
    import socket

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    state = random.getstate()
    random.seed(0)
    try:
        ports = {free_port() for _ in range(20)}
    finally:
        random.setstate(state)
    assert all(10000 <= p < min(low, 20000) for p in ports) and len(ports) > 1  # not drawn from random's seed
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free for the rank that binds it
