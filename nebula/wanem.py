"""WAN emulation: two network namespaces (one per site) joined by a veth pair shaped with tc tbf.

    with WanLink(name_prefix=f"nbt{os.getpid()}", rate_mbit=20) as link:
        server = link.popen("b", [sys.executable, "-m", "some.service", ...])  # runs in ns b
        print(measure_goodput(link, 4_000_000))          # Mbit/s of TCP payload, a -> b

Namespaces are `<prefix>-a` and `<prefix>-b`; each holds `lo` and one end of the pair, named `wan0`,
created directly inside its namespace so nothing appears (or collides) in the host namespace. The
addresses (first two hosts of `subnet`) exist only inside those namespaces.

tbf parameters, measured on this host (kernel 6.18, HZ=250, 2 busy shared cores; docs/wan.md has
the tables): a single TCP stream carries 1448 payload bytes per 1514-byte frame that tbf counts, so
95.6% of the shaped rate is the ceiling, and that is what we reach at 10, 60 and 170 Mbit/s.
- burst = max(rate x 4 ms, 10 frames). tbf refills its bucket from a timer; on a busy host the
  dequeue runs late, and tokens beyond `burst` are thrown away. A 1-2 frame burst lost 5-10% of the
  rate at 60-170 Mbit/s; one tick (4 ms at HZ=250) of rate held the ceiling. The 10-frame floor
  gives low rates the same slack (4 ms at 10 Mbit/s is only 3 frames).
- limit (queue) = burst + max(50 ms at the rate, 256 KiB). At 60-170 Mbit/s, 5 ms of queue lost
  packets on every transfer and 50 ms lost none. At 10 Mbit/s 50 ms is only 62 KB, less than the
  bursts a single socket puts in the qdisc (a 64 KB GSO packet alone), and bbr (this host's
  default) lost ~1 frame in 3; a 256 KiB floor (210 ms at 10 Mbit/s) lost none. Tens to hundreds
  of ms of queueing under a saturating transfer is also what real WAN links show.
- Small packets first: inside tbf, an HTB with two classes serves TCP packets under 128 bytes (pure
  ACKs) before bulk data. With both directions saturated (activations one way, gradients back) a
  FIFO made ACKs wait behind the other direction's data: at 0.5 Mbit/s one direction fell to 0.62
  of the rate; with the priority both directions keep 0.95-0.99 (60 Mbit/s: 0.94 both ways).
- Offloads stay on: tbf cuts GSO super-packets larger than `burst` into frames before queueing
  them, and turning gso/tso/gro off (ethtool) gained nothing measurable while costing CPU.
Propagation delay is not emulated (netem is missing from this kernel); see docs/wan.md.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

from nebula.errors import ConfigError, NebulaError

SITES = ("a", "b")
DEVICE = "wan0"
FRAME_BYTES = 1514  # what tbf counts for a full-size frame: 1500 MTU + 14 Ethernet header
TICK_S = 0.004  # one kernel tick at HZ=250
QUEUE_S = 0.050  # queue, as time at the link rate...
QUEUE_MIN_BYTES = 256 * 1024  # ...but never shorter than this (see the module docstring)
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_-]{0,40}$")


class WanError(NebulaError):
    """The WAN emulation cannot be set up, used or torn down on this host."""


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size: one timer tick of tokens, at least ten full frames (see the module docstring)."""
    return max(int(rate_mbit * 1e6 / 8 * TICK_S), 10 * FRAME_BYTES)


def tbf_limit_bytes(rate_mbit: float) -> int:
    """Queue size in bytes, counted the way tbf does (burst included)."""
    return tbf_burst_bytes(rate_mbit) + max(int(rate_mbit * 1e6 / 8 * QUEUE_S), QUEUE_MIN_BYTES)


class WanLink:
    """Two site namespaces and a shaped veth pair between them; a context manager that always cleans up.

    `up()` leaves the link in place (for `nebula wan up`); `down()` removes both namespaces and is
    safe to call when they are already gone.
    """

    def __init__(self, name_prefix: str = "nebula", rate_mbit: float = 60.0,
                 subnet: str = "10.213.0.0/30"):
        if not _PREFIX_RE.match(name_prefix):
            raise ConfigError(f"WAN name prefix {name_prefix!r} is invalid: use 1-41 lowercase "
                              "letters, digits, '-' or '_', starting with a letter")
        if not 0.1 <= rate_mbit <= 10_000:
            raise ConfigError(f"WAN rate {rate_mbit} Mbit/s is out of range: use 0.1 to 10000")
        self.prefix = name_prefix
        self.rate_mbit = float(rate_mbit)
        self._addresses = _site_addresses(subnet)
        self.subnet = subnet

    @classmethod
    def attach(cls, name_prefix: str) -> "WanLink":
        """A handle on a link that is already up (e.g. from `nebula wan up`), with its rate and subnet."""
        check_host()
        status = cls(name_prefix).status()
        if not all(status.values()) or status["a"]["qdisc"] is None or not status["a"]["addresses"]:
            raise WanError(f"WAN link {name_prefix} is not up: run `nebula wan up --prefix {name_prefix}`")
        subnet = ipaddress.ip_interface(status["a"]["addresses"][0]).network
        return cls(name_prefix, status["a"]["qdisc"]["rate_mbit"], str(subnet))

    # --- naming -------------------------------------------------------------------------
    def namespace(self, site: str) -> str:
        return f"{self.prefix}-{_check_site(site)}"

    def address(self, site: str) -> str:
        """The site's address on the WAN, reachable from the other site's namespace."""
        return self._addresses[_check_site(site)]

    def exec_prefix(self, site: str) -> list[str]:
        """argv prefix that runs a command inside the site's namespace."""
        return ["ip", "netns", "exec", self.namespace(site)]

    def popen(self, site: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` inside the site's namespace; kwargs go to subprocess.Popen."""
        return subprocess.Popen([*self.exec_prefix(site), *argv], **kwargs)

    def run(self, site: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` inside the site's namespace to completion; kwargs go to subprocess.run."""
        return subprocess.run([*self.exec_prefix(site), *argv], **kwargs)

    # --- lifecycle ------------------------------------------------------------------------
    def exists(self) -> list[str]:
        """Names of this link's namespaces that currently exist."""
        present = set(_existing_namespaces())
        return [self.namespace(s) for s in SITES if self.namespace(s) in present]

    def up(self) -> "WanLink":
        check_host()
        if taken := self.exists():
            raise WanError(f"network namespace(s) {', '.join(taken)} already exist: run "
                           f"`nebula wan down --prefix {self.prefix}` first, or pick another prefix")
        created: list[str] = []
        try:
            self._create(created)
        except BaseException:
            for name in created:  # leave nothing half-built, and never touch what we did not make
                _ip("netns", "delete", name)
            raise
        return self

    def down(self) -> None:
        for name in self.exists():
            _ip("netns", "delete", name)  # deleting a namespace destroys its end of the veth too

    def __enter__(self) -> "WanLink":
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def _create(self, created: list[str]) -> None:
        na, nb = self.namespace("a"), self.namespace("b")
        for name in (na, nb):
            _ip("netns", "add", name)
            created.append(name)
        _ip("-n", na, "link", "add", DEVICE, "type", "veth", "peer", "name", DEVICE, "netns", nb)
        prefixlen = ipaddress.ip_network(self.subnet).prefixlen
        burst = tbf_burst_bytes(self.rate_mbit)
        for site in SITES:
            ns = self.namespace(site)
            _ip("-n", ns, "addr", "add", f"{self.address(site)}/{prefixlen}", "dev", DEVICE)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", DEVICE, "up")
            # Each end shapes what it sends, so both directions are limited to the rate.
            _run(["tc", "-n", ns, "qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "tbf",
                  "rate", f"{self.rate_mbit}mbit", "burst", str(burst),
                  "limit", str(tbf_limit_bytes(self.rate_mbit))])
            _prioritise_small_packets(ns, tbf_limit_bytes(self.rate_mbit))

    # --- inspection -----------------------------------------------------------------------
    def status(self) -> dict:
        """Per site: namespace, address, and the tbf qdisc's settings and counters (None if absent)."""
        present = set(self.exists())
        return {site: _site_status(self, site) if self.namespace(site) in present else None
                for site in SITES}


def _site_status(link: WanLink, site: str) -> dict:
    ns = link.namespace(site)
    addrs = json.loads(_run(["ip", "-n", ns, "-4", "-j", "addr", "show", "dev", DEVICE]))
    qdiscs = json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", DEVICE]))
    tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), None)
    return {
        "namespace": ns,
        "addresses": [f"{a['local']}/{a['prefixlen']}" for i in addrs for a in i["addr_info"]],
        "qdisc": None if tbf is None else {
            "rate_mbit": tbf["options"]["rate"] * 8 / 1e6,
            "burst_bytes": tbf["options"]["burst"],
            "latency_us": tbf["options"]["lat"],
            **{k: tbf[k] for k in ("bytes", "packets", "drops", "overlimits", "backlog", "qlen")},
        },
    }


# --- host checks and command helpers ------------------------------------------------------
def _prioritise_small_packets(ns: str, limit_bytes: int) -> None:
    """Inside tbf, serve small TCP packets (pure ACKs, SYNs) before bulk data.

    When both directions are saturated (forward activations one way, gradients the other), each
    connection's ACKs share a queue with the other connection's data. A FIFO then delays ACKs by the
    whole queue (seconds at sub-Mbit/s rates), which collapses TCP throughput far below the link
    rate; a router with per-flow or small-packet priority does not. HTB here only orders the two
    classes (its rates are far above the link's); tbf still sets the pace.
    """
    tc = ["tc", "-n", ns]
    _run([*tc, "qdisc", "add", "dev", DEVICE, "parent", "1:1", "handle", "10:", "htb", "default", "20"])
    _run([*tc, "class", "add", "dev", DEVICE, "parent", "10:", "classid", "10:1", "htb",
          "rate", "10gbit", "quantum", "15140"])
    for classid, prio in (("10:10", "0"), ("10:20", "1")):
        _run([*tc, "class", "add", "dev", DEVICE, "parent", "10:1", "classid", classid, "htb",
              "rate", "5gbit", "ceil", "10gbit", "prio", prio, "quantum", "15140"])
        _run([*tc, "qdisc", "add", "dev", DEVICE, "parent", classid, "bfifo", "limit", str(limit_bytes)])
    # IPv4 TCP with total length < 128 bytes: ACK-only and control packets
    _run([*tc, "filter", "add", "dev", DEVICE, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
          "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2",
          "flowid", "10:10"])


def check_host() -> None:
    """Raises WanError unless this process can create namespaces and shape links."""
    if os.geteuid() != 0:
        raise WanError("needs root: network namespaces and tc need CAP_NET_ADMIN "
                       "(run with sudo, or as root in a container started with --privileged)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise WanError(f"`{tool}` is missing: install the {package} package "
                           f"(apt-get install {package})")


def _existing_namespaces() -> list[str]:
    # `ip netns list` prints "name (id: N)" per line; the name is the first word.
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    except FileNotFoundError as exc:
        raise WanError(f"`{argv[0]}` is missing: install iproute2") from exc
    except subprocess.CalledProcessError as exc:
        raise WanError(f"`{' '.join(argv)}` failed: {exc.stderr.strip() or exc.returncode}") from exc
    except subprocess.TimeoutExpired as exc:
        raise WanError(f"`{' '.join(argv)}` hung for 30 s; check the host's network stack") from exc
    return done.stdout


def _check_site(site: str) -> str:
    if site not in SITES:
        raise ConfigError(f"unknown WAN site {site!r}: use one of {', '.join(SITES)}")
    return site


def _site_addresses(subnet: str) -> dict[str, str]:
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as exc:
        raise ConfigError(f"WAN subnet {subnet!r} is invalid: give an IPv4 network such as "
                          "10.213.0.0/30") from exc
    if not net.is_private or net.prefixlen > 30:
        raise ConfigError(f"WAN subnet {subnet} must be private and hold two hosts (/30 or larger), "
                          "so it can exist only inside the emulation's namespaces")
    # network+1 and network+2 are hosts for any /30 or larger; no need to list every host.
    return {"a": str(net.network_address + 1), "b": str(net.network_address + 2)}


# --- goodput measurement ------------------------------------------------------------------
CHUNK = 1 << 20


def measure_goodput(link: WanLink, nbytes: int, src: str = "a", dst: str = "b",
                    timeout_s: float | None = None) -> float:
    """Sends `nbytes` over one plain TCP connection from site `src` to site `dst`; returns Mbit/s.

    Both ends are separate processes inside their namespaces (`python -m nebula.wanem recv|send`).
    The receiver times from accepting the connection to end of stream, so the figure includes slow
    start and is the payload rate a transfer of this size actually gets.
    """
    if nbytes <= 0:
        raise ConfigError(f"goodput transfer size must be positive, got {nbytes}")
    if timeout_s is None:  # ten times the wire time, plus process start-up
        timeout_s = 10 * nbytes * 8 / (link.rate_mbit * 1e6) + 10
    recv = link.popen(dst, [sys.executable, "-m", "nebula.wanem", "recv", link.address(dst),
                            str(timeout_s)], stdout=subprocess.PIPE, text=True)
    try:
        port = _read_ready_port(recv)
        link.run(src, [sys.executable, "-m", "nebula.wanem", "send", link.address(dst), str(port),
                       str(nbytes)], check=True, timeout=timeout_s, capture_output=True)
        out, _ = recv.communicate(timeout=timeout_s)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", None) or ""
        raise WanError(f"goodput transfer {src} -> {dst} failed: {exc} {detail}".strip()) from exc
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    result = json.loads(out)
    if result["bytes"] != nbytes:
        raise WanError(f"goodput receiver got {result['bytes']} of {nbytes} bytes")
    return result["bytes"] * 8 / result["seconds"] / 1e6


def _read_ready_port(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise WanError(f"goodput receiver failed to start (said {line!r}); is the link up?")
    return int(line.split()[1])


def _receive(host: str, timeout_s: float) -> None:
    with socket.create_server((host, 0)) as server:
        server.settimeout(timeout_s)  # never outlive a sender that failed to start
        print(f"ready {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            start, total, buf = time.perf_counter(), 0, bytearray(CHUNK)
            while n := conn.recv_into(buf):
                total += n
            seconds = time.perf_counter() - start
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def _send(host: str, port: int, nbytes: int) -> None:
    chunk = memoryview(bytes(CHUNK))
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.settimeout(None)
        for start in range(0, nbytes, CHUNK):
            conn.sendall(chunk[: min(CHUNK, nbytes - start)])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # returns when the receiver has read everything and closed


if __name__ == "__main__":
    # The two ends of measure_goodput, run inside the site namespaces.
    if sys.argv[1:2] == ["recv"]:
        _receive(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1:2] == ["send"]:
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: python -m nebula.wanem recv HOST TIMEOUT_S | send HOST PORT NBYTES")
