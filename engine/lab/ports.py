"""Ports and loopback addresses chosen at run time, so that a test run and a running lab never collide.

Ports come from below the kernel's ephemeral range (outgoing connections never take them) and are
checked free by binding. Node-host addresses come from a random 127.X.Y.0/24 whose port 22 is free.
Everything here is loopback: this module refuses any other address. It binds and closes sockets,
nothing more.
"""

from __future__ import annotations

import errno
import ipaddress
import random
import socket
import threading

_PORT_RANGE = (20000, 32000)  # below net.ipv4.ip_local_port_range's usual 32768
_handed_out: set[tuple[str, int]] = set()
_lock = threading.Lock()


def require_loopback(address: str) -> str:
    """Return ``address`` if it is an IPv4 loopback address; raise ValueError otherwise."""
    if not ipaddress.IPv4Address(address).is_loopback:
        raise ValueError(f"refusing a non-loopback address: {address}")
    return address


def port_is_free(address: str, port: int) -> bool:
    """True when ``address:port`` can be bound now (nobody listens there)."""
    require_loopback(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_port(address: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port free on ``address``, never handed out before by this process."""
    rng = rng or random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        with _lock:
            if (address, port) in _handed_out or not port_is_free(address, port):
                continue
            _handed_out.add((address, port))
            return port
    raise RuntimeError(f"no free port on {address} in {_PORT_RANGE}")


def free_ports(count: int, address: str = "127.0.0.1") -> list[int]:
    return [free_port(address) for _ in range(count)]


def free_loopback_block(size: int, port: int = 22, rng: random.Random | None = None) -> list[str]:
    """``size`` loopback addresses 127.X.Y.1..size (X in 100..199) whose ``port`` is free on each.

    One random /24 per call (a /23.. when size > 254 is not supported): a lab and a test run pick
    different blocks. Never 127.0.0.0/16 (127.0.1.1 is the machine's own hostname on Debian).
    """
    if not 1 <= size <= 254:
        raise ValueError(f"between 1 and 254 hosts per block, not {size}")
    rng = rng or random.SystemRandom()
    for _ in range(200):
        prefix = f"127.{rng.randrange(100, 200)}.{rng.randrange(0, 256)}"
        addresses = [f"{prefix}.{n}" for n in range(1, size + 1)]
        with _lock:
            if any((a, port) in _handed_out for a in addresses):
                continue
            if all(port_is_free(a, port) for a in addresses):
                _handed_out.update((a, port) for a in addresses)
                return addresses
    raise RuntimeError("no free loopback /24 found")
