"""The interface gloo binds to, on a two-node network built for real with network namespaces.

Each "node" is a namespace with two NICs: a fabric NIC (10.231.0.0/24, a veth pair between the two
nodes) and a second NIC whose network does not reach the other node, which the node's hostname
resolves to (its own /etc/hosts, as `ip netns exec` mounts it): gloo's default, binding to the
hostname's address, then advertises an address the peer cannot connect to and retries until the
group's timeout (it was a day for the side group). vitp picks the NIC that routes to MASTER_ADDR,
and bounds every group's setup by engine.rendezvous_timeout_s. On the master node, where Ubuntu's
`127.0.1.1 <hostname>` makes MASTER_ADDR loopback, it routes to another node of the job instead.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import unavailable

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
MASTER = "10.231.0.1"

RANK = r"""
import json, os, sys, time
import torch
import pipeline.distributed as pd
rank, port, timeout, master = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t = time.monotonic()
try:
    pd.init_process_group(pd.DistEnv(rank=rank, world_size=2, master_addr=master, master_port=port),
                          "gloo", timeout)
except pd.RendezvousError as e:
    print(json.dumps({"error": str(e), "s": time.monotonic() - t}), flush=True)
    sys.exit(3)
formed = time.monotonic() - t
pd.wait_for_rank0()
x = torch.tensor([float(rank + 1)])
pd.all_reduce(x)
pd.leave_process_group()
print(json.dumps({"ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "s": formed, "sum": x.item()}), flush=True)
"""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


@pytest.fixture
def two_nodes():
    """Namespaces <tag>a and <tag>b; node a: fabric fa0 10.231.0.1 + mgmt ma0 10.232.1.1 (the hostname's
    address); node b: fb0 10.231.0.2 + mb0 10.232.2.1. Yields the namespace names; removes everything."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("building network namespaces needs root and iproute2")
    tag = f"vitpg{os.getpid() % 100000}"
    nodes = {"a": ("10.231.0.1", "10.232.1.1"), "b": ("10.231.0.2", "10.232.2.1")}
    try:
        for n in nodes:
            sh("ip", "netns", "add", tag + n)
        sh("ip", "link", "add", f"{tag}fa", "type", "veth", "peer", "name", f"{tag}fb")
        for n, (fabric, mgmt) in nodes.items():
            ns = tag + n
            sh("ip", "link", "set", f"{tag}f{n}", "netns", ns)
            sh("ip", "-n", ns, "link", "set", f"{tag}f{n}", "name", f"f{n}0")
            # the second NIC: a veth pair inside the node, its network reaches nothing else
            sh("ip", "-n", ns, "link", "add", f"m{n}0", "type", "veth", "peer", "name", f"m{n}1")
            sh("ip", "-n", ns, "addr", "add", f"{fabric}/24", "dev", f"f{n}0")
            sh("ip", "-n", ns, "addr", "add", f"{mgmt}/24", "dev", f"m{n}0")
            for dev in ("lo", f"f{n}0", f"m{n}0", f"m{n}1"):
                sh("ip", "-n", ns, "link", "set", dev, "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{mgmt} {socket.gethostname()}\n")
        yield {n: tag + n for n in nodes}
    finally:
        for n in nodes:
            subprocess.run(["ip", "netns", "del", tag + n], capture_output=True, timeout=60)
            shutil.rmtree(Path("/etc/netns") / (tag + n), ignore_errors=True)
        subprocess.run(["ip", "link", "del", f"{tag}fa"], capture_output=True, timeout=60)


def run_pair(nodes: dict, timeout_s: float, ifnames: dict | None = None, master: str = MASTER,
             env_add: dict | None = None, on: tuple = ("a", "b")) -> list[tuple[int, dict]]:
    """Rank 0 on node a, rank 1 on node b (``on``: the nodes whose rank starts); ``ifnames``: a
    GLOO_SOCKET_IFNAME per node, set by the user; ``env_add``: more variables for every rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "RANK", "WORLD_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env_add or {}))
    port = 29000 + os.getpid() % 1000
    procs = [subprocess.Popen(["ip", "netns", "exec", nodes[n], sys.executable, "-c", RANK, str(rank), str(port),
                               str(timeout_s), master],
                              env={**env, **({"GLOO_SOCKET_IFNAME": ifnames[n]} if ifnames else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, n in enumerate(("a", "b")) if n in on]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout_s + 120)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        assert lines, stderr[-2000:]
        out.append((p.returncode, json.loads(lines[-1])))
    return out


def test_hostname_resolves_to_the_other_nic_there(two_nodes):
    """The trap is set: inside node b the hostname is the unreachable NIC's address."""
    r = subprocess.run(["ip", "netns", "exec", two_nodes["b"], sys.executable, "-c",
                        "import socket; print(socket.gethostbyname(socket.gethostname()))"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "10.232.2.1"


def test_gloo_binds_to_the_nic_that_routes_to_the_master(two_nodes):
    results = run_pair(two_nodes, timeout_s=60)
    assert [rc for rc, _ in results] == [0, 0], results
    assert [res["ifname"] for _, res in results] == ["fa0", "fb0"]
    assert all(res["sum"] == 3.0 for _, res in results)  # 1 + 2 over the fabric
    assert all(res["s"] < 20 for _, res in results), results  # both groups formed at once, not at a timeout


def test_an_unreachable_interface_fails_within_rendezvous_timeout_in_one_line(two_nodes):
    """Each node's hostname NIC pinned by the user (exactly where gloo binds without a choice): the
    ranks advertise addresses the peer cannot reach. Each fails with one line naming the interface,
    bounded by engine.rendezvous_timeout_s (3 s here), not a day: node b's connect is refused at once
    (no route), node a waits for it and gloo retries that wait (measured: 5 x the timeout)."""
    timeout = 3
    results = run_pair(two_nodes, timeout_s=timeout, ifnames={"a": "ma0", "b": "mb0"})
    for (rc, res), nic in zip(results, ("ma0", "mb0")):
        assert rc == 3, results
        assert "\n" not in res["error"] and res["error"].startswith("rank ")
        assert f"gloo on {nic} (GLOO_SOCKET_IFNAME)" in res["error"] and "engine.rendezvous_timeout_s" in res["error"]
        assert res["s"] < 6 * timeout + 10, results
    assert results[0][1]["s"] >= timeout  # rank 0 waited for the bound: the failure is the timeout's


def master_is_loopback_on_node_a(nodes: dict, default_via: str | None) -> None:
    """Ubuntu's /etc/hosts on the master: its name (and the hostname) is 127.0.1.1 there, a fabric
    address elsewhere; ``default_via``: node a's default gateway (None: no default route)."""
    host = socket.gethostname()
    (Path("/etc/netns") / nodes["a"] / "hosts").write_text(
        f"127.0.0.1 localhost\n127.0.1.1 {host} nodea\n10.231.0.2 nodeb\n")
    (Path("/etc/netns") / nodes["b"] / "hosts").write_text(
        f"127.0.0.1 localhost\n10.232.2.1 {host}\n10.231.0.1 nodea\n10.231.0.2 nodeb\n")
    if default_via:
        sh("ip", "-n", nodes["a"], "route", "add", "default", "via", default_via)


@pytest.mark.parametrize("launcher, default_via", [("slurm", "10.232.1.2"), ("torchrun", "10.231.0.2")])
def test_the_master_node_never_binds_gloo_to_loopback(two_nodes, launcher, default_via):
    """On the master node MASTER_ADDR routes to lo: under SLURM gloo takes the NIC that routes to another
    node of the allocation (even where the default route leads elsewhere: ma0 here); under torchrun
    (no node list) the default route's NIC. Either way the group forms over the fabric at once."""
    master_is_loopback_on_node_a(two_nodes, default_via)
    slurm = {"SLURM_JOB_NODELIST": "nodea,nodeb"} if launcher == "slurm" else {}
    results = run_pair(two_nodes, timeout_s=20, master="nodea", env_add=slurm)
    assert [rc for rc, _ in results] == [0, 0], results
    assert [res["ifname"] for _, res in results] == ["fa0", "fb0"]
    assert all(res["sum"] == 3.0 for _, res in results) and all(res["s"] < 15 for _, res in results), results


def test_a_master_with_no_way_off_the_node_fails_in_one_line(two_nodes):
    """Loopback, no other node in the list reachable, no default route: one line, at once."""
    master_is_loopback_on_node_a(two_nodes, None)
    [(rc, res)] = run_pair(two_nodes, timeout_s=20, master="nodea", env_add={"SLURM_JOB_NODELIST": "nodea"},
                           on=("a",))
    assert rc == 3 and "\n" not in res["error"] and res["s"] < 10, res
    assert res["error"] == ("rank 0/2: MASTER_ADDR nodea is this node's loopback address (127.0.1.1), no other "
                            "node of SLURM_JOB_NODELIST=nodea routes off it and there is no default route: set "
                            "GLOO_SOCKET_IFNAME to the interface the other nodes reach")
