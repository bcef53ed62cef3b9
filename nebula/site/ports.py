"""Free TCP ports for services on one host: local sites' gateways, the master port of a stage's ranks."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED: set[int] = set()  # ports this process gave out: never twice, whoever binds first
_PICK = random.SystemRandom()  # not the global RNG, which jobs and tests seed alike in many processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, below the kernel's ephemeral range. A port from
    bind(0) is ephemeral: until its user binds it, any process's outgoing connection may take it as
    its source port ("Address already in use" in a CI run of the chaos test); below the range only
    an explicit bind can."""
    low = ephemeral_low()
    for _ in range(256 if low >= 11024 else 0):
        port = _PICK.randrange(low - 10000, low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:  # no room below the range (or all taken): an ephemeral port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess that the loop's bind checks
