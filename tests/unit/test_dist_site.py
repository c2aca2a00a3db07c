"""What a real site does to a rank's process group, on one CPU machine: per-task GPU binding (a faked
visible-device count), DeepSpeed's rule for binding the group to its device, torchrun's agent store,
and the interface gloo binds to."""

import os

import pytest
import torch

import pipeline.distributed as pd
from pipeline import network
from pipeline.distributed import DistEnv


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda with ``n`` visible devices (set_device recorded); LOCAL_* restored afterwards."""
    calls = []
    monkeypatch.setattr(pd, "_COMM_DEVICE", None)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(k, "0")

    def visible(n: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return calls

    return visible


def deepspeed_zero3_device() -> torch.device:
    """The device DeepSpeed's ZeRO-3 puts gathered parameters on (runtime/zero/partition_parameters.py:
    ``get_accelerator().device_name(os.environ["LOCAL_RANK"])``) with its CUDA accelerator."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    return torch.device(CUDA_Accelerator().device_name(os.environ["LOCAL_RANK"]))


def test_per_task_binding_makes_local_rank_the_visible_device(fake_gpus, monkeypatch):
    """srun --gpus-per-task=1: task 5 of 8 on the node sees one GPU; DeepSpeed must use cuda:0."""
    calls = fake_gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    d = DistEnv(rank=13, world_size=16, local_rank=5, local_world_size=8)
    assert pd._set_comm_device("nccl", d) == torch.device("cuda", 0)
    assert calls == [0]
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("0", "1")
    assert deepspeed_zero3_device() == torch.device("cuda", 0) == pd.comm_device()


def test_whole_node_visible_keeps_local_rank(fake_gpus, monkeypatch):
    calls = fake_gpus(8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    d = DistEnv(rank=13, world_size=16, local_rank=5, local_world_size=8)
    assert pd._set_comm_device("nccl", d) == torch.device("cuda", 5) and calls == [5]
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("5", "8")
    assert deepspeed_zero3_device() == torch.device("cuda", 5)


def test_gloo_leaves_local_rank_alone(fake_gpus, monkeypatch):
    fake_gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pd._set_comm_device("gloo", DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)).type == "cpu"
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "2")


CUDA1 = torch.device("cuda", 1)


@pytest.mark.parametrize("backend, world, device, version, bound", [
    ("nccl", 16, CUDA1, "2.14.1+cu130", True),
    ("nccl", 16, CUDA1, "2.13.0", True),
    ("nccl", 1, CUDA1, "2.14.1", False),            # a group of one: no peer for ncclCommSplit (DeepSpeed #8248)
    ("nccl", 16, CUDA1, "2.6.0+cu124", False),       # pytorch#153960: random hangs with device_id
    ("nccl", 16, CUDA1, "2.7.0", False),
    ("nccl", 16, CUDA1, "2.7.1", True),
    ("nccl", 16, CUDA1, "2.5.1", True),
    ("gloo", 16, torch.device("cpu"), "2.14.1", False),
])
def test_device_id_is_passed_where_deepspeed_passes_it(backend, world, device, version, bound):
    assert pd.device_id_arg(backend, world, device, version) == ({"device_id": device} if bound else {})


def test_torchrun_agent_store_is_recognised():
    d = DistEnv(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29511, source="env")
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    assert pd.agent_store_serves(d, agent)
    assert not pd.agent_store_serves(d, {**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not pd.agent_store_serves(d, {**agent, "MASTER_PORT": "29512"})  # the agent serves another port
    assert not pd.agent_store_serves(d, {})


def test_gloo_interface_is_the_one_that_routes_to_the_master(monkeypatch):
    addrs = network.interface_addresses()
    assert "127.0.0.1" in addrs["lo"]
    assert network.route_interface("127.0.0.1") == "lo"
    # this node's own non-loopback address: the NIC that holds it (what other nodes reach), not the
    # routing table's "local ... dev lo"
    for name, a in addrs.items():
        v4 = [x for x in a if "." in x and not x.startswith("127.")]
        if name != "lo" and v4:
            assert network.route_interface(v4[0]) == name
    assert network.route_interface("no-such-host.invalid") is None
    env = {}
    assert network.choose_gloo_interface("127.0.0.1", env) == "lo" and env == {"GLOO_SOCKET_IFNAME": "lo"}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}  # the user's choice stands
    assert network.choose_gloo_interface("127.0.0.1", env) == "ib0" and env == {"GLOO_SOCKET_IFNAME": "ib0"}
