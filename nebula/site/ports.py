"""Free TCP ports for services on one host: local sites' gateways, the master port of a stage's ranks."""
from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

_HANDED: set[int] = set()  # ports this process gave out: never twice, whoever binds first
_PICK = random.SystemRandom()  # not the global RNG, which jobs and tests seed alike in many processes
CLAIM_S = 300.0  # a port another process on this host was handed is not handed again for this long


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, below the kernel's ephemeral range. A port from
    bind(0) is ephemeral: until its user binds it, any process's outgoing connection may take it as
    its source port ("Address already in use" in a CI run of the chaos test); below the range only
    an explicit bind can."""
    low = ephemeral_low()
    for _ in range(256 if low >= 11024 else 0):
        port = _PICK.randrange(low - 10000, low)
        if port in _HANDED or not _claim(port):
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


def _claim(port: int) -> bool:
    """Claim `port` for CLAIM_S host-wide (a file per port in the temporary directory): between the pick and
    its user's bind, a port is free to any other process's pick too; two local sites, demos or test
    workers picking at once then got the same port ("Address already in use" at the later bind)."""
    claims = Path(tempfile.gettempdir()) / f"nebula-ports-{os.getuid()}"
    try:
        claims.mkdir(mode=0o700, exist_ok=True)
        mark = claims / str(port)
        for _ in range(2):
            try:
                os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                return True
            except FileExistsError:
                try:
                    if time.time() - mark.stat().st_mtime < CLAIM_S:
                        return False
                except FileNotFoundError:  # another process cleared the old claim meanwhile: try again
                    continue
                mark.unlink(missing_ok=True)  # an old claim: its user bound the port long ago, or never will
        return False
    except OSError:  # no writable temporary directory: the bind below is the only check, as before
        return True


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess that the loop's bind checks
