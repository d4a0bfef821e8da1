"""Ports a child process will bind: free now, and below the kernel's ephemeral range. A port of
that range, closed and handed on, may meanwhile become the source port of any process's outgoing
connection, and the child's bind fails (two test workers made a server's bind fail so)."""

from __future__ import annotations

import errno
import ipaddress
import random
import socket
from pathlib import Path

BELOW = 12000  # how far below the range's start ports are drawn from
TRIES = 64


def _range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a port drawn below it is as good


def port_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound on `host` to a free port below the ephemeral range (any free port when
    none of TRIES random ones is free)."""
    start, pick = _range_start(), random.SystemRandom()
    candidates = [pick.randrange(max(1024, start - BELOW), start) for _ in range(TRIES)] if start > 2048 else []
    for port in [*candidates, 0]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.EADDRINUSE, errno.EACCES):  # not this port's fault: no other will do
                raise
    raise OSError(f"no free port on {host}")


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host` (a name, an IPv4 or IPv6 address; "" for every interface)
    and `port`."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0] if host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now on `host` (see port_socket)."""
    with port_socket(host) as sock:
        return sock.getsockname()[1]
