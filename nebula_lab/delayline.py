"""A user-space delay line: propagation delay on an emulated WAN link, where the kernel has no netem.

    python -m nebula_lab.delayline TUN DEVICE PEER DELAY_S    # inside a site's namespace (nebula_lab.wanem)

In a site's namespace, the route to the peer's end of the link (a /32, more specific than the
link's /30) leads into a TUN device; this process reads each IPv4 packet from it, holds it for
DELAY_S, then sends it unchanged out of the link's veth DEVICE through a raw IP socket bound to that
device. So every packet the site sends to the peer waits DELAY_S before it reaches the link's tbf
(same packets, same order: a fixed delay never reorders), and each end delaying half the RTT gives
the RTT. What the peer sends back takes its own delay line.

Why these pieces:
- TUN without IFF_VNET_HDR: the kernel segments GSO packets and fills checksums before handing them
  over, so what we hold are ready MTU-sized packets (the TUN's MTU is the veth's, 1500).
- raw socket (IPPROTO_RAW, the IP header is ours) with SO_BINDTODEVICE: its route lookup may use
  only DEVICE, so it skips the /32 into the TUN (no loop) and takes the link's /30; the packet then
  goes through the neighbour table (WanLink.cut still works) and DEVICE's qdisc (tbf, ACKs first).
- a deque, not a heap: the delay is fixed, so due times arrive in order.
- the queue is bounded (MAX_HELD_BYTES); beyond it packets are dropped as a full router queue drops
  them. TCP never has more than its window in flight, so the bound is only a guard.
"""
from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65535
MAX_HELD_BYTES = 64 << 20  # 64 MiB: 2.7 s at 200 Mbit/s, far beyond any window we emulate


def open_tun(name: str) -> int:
    """Attach to the TUN device `name` (created beforehand with `ip tuntap add`); a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def open_sender(device: str, peer: str) -> socket.socket:
    """A raw socket that sends whole IPv4 packets (our header) to `peer`, out of `device` only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.connect((peer, 0))
    return sock


class DelayLine:
    """Packets in, the same packets out `delay_s` later; the clock is time.monotonic()."""

    def __init__(self, delay_s: float, max_bytes: int = MAX_HELD_BYTES) -> None:
        self.delay_s, self.max_bytes = delay_s, max_bytes
        self.held: deque[tuple[float, bytes]] = deque()
        self.held_bytes = 0
        self.dropped = 0

    def push(self, packet: bytes, now: float) -> None:
        if self.held_bytes + len(packet) > self.max_bytes:
            self.dropped += 1
            return
        self.held.append((now + self.delay_s, packet))
        self.held_bytes += len(packet)

    def due(self, now: float) -> list[bytes]:
        """The packets whose time has come, oldest first."""
        out = []
        while self.held and self.held[0][0] <= now:
            packet = self.held.popleft()[1]
            self.held_bytes -= len(packet)
            out.append(packet)
        return out

    def wait_s(self, now: float) -> float | None:
        """How long until the next packet is due; None when nothing is held."""
        return max(0.0, self.held[0][0] - now) if self.held else None


def run(tun: str, device: str, peer: str, delay_s: float) -> None:
    fd, sock, line = open_tun(tun), open_sender(device, peer), DelayLine(delay_s)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # whoever started us may be gone: never write to them
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    while True:
        readable, _, _ = select.select([fd], [], [], line.wait_s(time.monotonic()))
        now = time.monotonic()
        if readable:
            _read_all(fd, line, now)
        for packet in line.due(now):
            try:
                sock.send(packet)
            except OSError:  # e.g. ENOBUFS with a full qdisc: lost, as a router would lose it
                pass


def _read_all(fd: int, line: DelayLine, now: float) -> None:
    while True:
        try:
            packet = os.read(fd, MAX_PACKET)
        except BlockingIOError:
            return
        if packet and packet[0] >> 4 == 4:  # IPv4 only: the link carries no IPv6
            line.push(packet, now)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m nebula_lab.delayline TUN DEVICE PEER DELAY_S")
    run(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
