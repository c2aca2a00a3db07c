"""Which network interface this node's gloo traffic uses: the one that routes to MASTER_ADDR
(:func:`choose_gloo_interface`), not whatever the hostname resolves to on a multi-NIC node.
pipeline.distributed calls it when it joins a group of more than one process.
"""

from __future__ import annotations

import os


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


def route_interface(addr: str) -> str | None:
    """The interface this node would use to reach ``addr`` (name or address), or None if unknown.

    A UDP connect sends nothing: the kernel only picks the route and its source address, and the
    interface holding that address is the one (for ``addr`` on this very node, the NIC that holds
    it, which is what the other nodes reach, not ``lo`` as the routing table says).
    """
    import socket

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            src = s.getsockname()[0]
    except OSError:
        return None
    src = src.split("%")[0]
    names = [n for n, addrs in interface_addresses().items() if src in addrs]
    return sorted(names)[0] if names else None


def choose_gloo_interface(master_addr: str, environ=None) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface that routes to ``master_addr`` unless the user set it;
    returns the interface gloo will use (None: gloo's own choice, by the hostname).

    Without it gloo binds to whatever the hostname resolves to: on a multi-NIC node (or with
    ``127.0.1.1 <hostname>`` in /etc/hosts) that address may not be reachable from the other nodes,
    and each connect is retried until the group's timeout.
    """
    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    name = route_interface(master_addr)
    if name:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
