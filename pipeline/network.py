"""Which network interface this node's gloo traffic uses: the one that routes to MASTER_ADDR
(:func:`choose_gloo_interface`), not whatever the hostname resolves to on a multi-NIC node; on the
master node of a job that spans nodes, never loopback. pipeline.distributed calls it when it joins a
group of more than one process. Also the rendezvous ports: a SLURM job's (:func:`rendezvous_port`) and a
single node's (:func:`free_port`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess


class InterfaceError(RuntimeError):
    """No interface of this node reaches the job's other nodes; the message is one line."""


def interface_addresses() -> dict[str, set[str]]:
    """Every interface's IPv4 and IPv6 addresses: {"eth0": {"10.0.0.5", "fe80::1"}, "lo": {...}}."""
    import fcntl
    import ipaddress
    import socket
    import struct

    found: dict[str, set[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found.setdefault(name, set()).add(socket.inet_ntoa(raw[20:24]))
            except OSError:  # no IPv4 address on it
                pass
    try:
        with open("/proc/net/if_inet6") as f:  # "addr(32 hex) index prefix scope flags name"
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    found.setdefault(parts[5], set()).add(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    except OSError:
        pass
    return found


def route_source(addr: str) -> str | None:
    """The source address this node would use to reach ``addr`` (name or address), or None.

    A UDP connect sends nothing: the kernel only picks the route and its source address (for
    ``addr`` on this very node, that address itself)."""
    import socket

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0].split("%")[0]
    except OSError:
        return None


def holder(src: str) -> str | None:
    """The interface that holds the address ``src``."""
    names = [n for n, addrs in interface_addresses().items() if src in addrs]
    return sorted(names)[0] if names else None


def route_interface(addr: str) -> str | None:
    """The interface this node would use to reach ``addr`` (name or address), or None if unknown:
    the one holding the route's source address (for ``addr`` on this very node, the NIC that holds
    it, which is what the other nodes reach, not ``lo`` as the routing table says)."""
    src = route_source(addr)
    return holder(src) if src else None


def is_loopback(addr: str | None) -> bool:
    import ipaddress

    try:
        return addr is not None and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def default_route_interface(route_table: str = "/proc/net/route") -> str | None:
    """The interface of this node's IPv4 default route (the lowest metric), or None without one."""
    try:
        with open(route_table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    # Iface Destination Gateway Flags RefCnt Use Metric Mask ...; flags 0x1: the route is up
    defaults = [(int(r[6]), r[0]) for r in rows
                if len(r) >= 8 and r[1] == "00000000" and r[7] == "00000000" and int(r[3], 16) & 1 and r[0] != "lo"]
    return min(defaults)[1] if defaults else None


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: "gpu[01-03,7],login" -> gpu01 gpu02 gpu03 gpu7 login
    (what ``scontrol show hostnames`` prints; used where scontrol is missing)."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[\]]*)(?:\[([^\]]*)\])?([^,\[\]]*),?", nodelist):
        if not ranges:
            if prefix + suffix:
                hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def slurm_hostnames(nodelist: str) -> list[str]:
    """Every host of a SLURM node list ("node[1-2]" -> node1 node2); scontrol knows every syntax."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_hostlist(nodelist)


def off_node_interface(master_addr: str, env) -> str:
    """On the master node of a job that spans nodes, where MASTER_ADDR resolves to loopback (Ubuntu's
    ``127.0.1.1 <hostname>`` in /etc/hosts): the interface that routes to another host of the
    allocation (SLURM's node list), else the default route's; InterfaceError without either."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    for host in slurm_hostnames(nodelist) if nodelist else []:
        src = route_source(host)
        if src and not is_loopback(src) and holder(src):
            return holder(src)
    name = default_route_interface()
    if name:
        return name
    where = f"no other node of SLURM_JOB_NODELIST={nodelist}" if nodelist else "no node list"
    try:  # the address the name resolves to (127.0.1.1), not the source of its route (lo's 127.0.0.1)
        resolved = socket.gethostbyname(master_addr)
    except OSError:
        resolved = route_source(master_addr)
    raise InterfaceError(f"MASTER_ADDR {master_addr} is this node's loopback address ({resolved}), "
                         f"{where} routes off it and there is no default route: set GLOO_SOCKET_IFNAME to the "
                         "interface the other nodes reach")


def choose_gloo_interface(master_addr: str, environ=None, *, spans_nodes: bool = False) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface that routes to ``master_addr`` unless the user set it;
    returns the interface gloo will use (None: gloo's own choice, by the hostname).

    Without it gloo binds to whatever the hostname resolves to: on a multi-NIC node (or with
    ``127.0.1.1 <hostname>`` in /etc/hosts) that address may not be reachable from the other nodes,
    and each connect is retried until the group's timeout. When the job ``spans_nodes`` and
    ``master_addr`` is a name that resolves to loopback here (this is the master node), loopback is
    never the answer (:func:`off_node_interface`); a loopback literal or ``localhost`` as master means
    one node, where ``lo`` is right.
    """
    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    src = route_source(master_addr)
    named = not is_loopback(master_addr) and master_addr != "localhost"
    if spans_nodes and named and is_loopback(src):
        name = off_node_interface(master_addr, env)
    else:
        name = holder(src) if src else None
    if name:
        env["GLOO_SOCKET_IFNAME"] = name
    return name


def rendezvous_port(job_id: str, restart: int = 0) -> int:
    """A port every task of a job derives alone; a requeued job (restart > 0) gets a fresh one,
    so a socket of the previous attempt lingering in TIME_WAIT cannot clash."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return 20000 + (int(digits) * 7 + restart) % 20000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds right now (for single-node rendezvous), below the kernel's
    ephemeral range and :func:`rendezvous_port`'s: the ranks bind it later, and a port the kernel hands out
    to any outgoing connection meanwhile (another job's, a tracking client's) would be taken by then. Drawn
    from the OS's randomness: a process that seeded ``random`` alike must not draw alike."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(low, 20000)
    for port in random.SystemRandom().sample(range(10000, top), min(64, max(0, top - 10000))):
        if port_free(port, "127.0.0.1"):
            return port
    with socket.socket() as s:  # no such range here: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "") -> bool:
    """True when ``port`` can be bound here (SO_REUSEADDR, like torch's TCPStore server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
