"""Addresses and ports: whether a host is this machine's loopback, and a port free now.

Both the cluster (a Ray address, the host a server binds) and the engines (the address a
server advertises to its own workers) ask them; neither is any engine's knowledge.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1); not a name that resolves to one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip(host: str) -> bool:
    """Whether `host` is an IPv4 or IPv6 address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the OS picks it; a race with other binders is
    possible but rare, and a clash shows up as a start failure naming the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
