"""`nebula bench flood`: what one stage holding a valid certificate can make its gateway write and hold.

Two local sites, their gateways real processes with the site defaults, CURVE everywhere. One
scenario at a time, each on fresh sites, for `--seconds` (default 20):

- messages:   stage a/flood/0 sends TENSORS to b/sink/0 as fast as its socket takes them (a raw
              socket: it ignores the reliable channel's window); b/sink/0 reads everything;
- garbage:    it sends frames that are no envelope;
- handshakes: strangers: clients with a fresh random CURVE key per connection, on a's stage port;
- stalled:    it sends 256 KiB TENSORS to a/stall/0, a stage of its own site that never reads;
- stalled-small: the same with 1 KiB TENSORS, where what a queued message costs beyond its bytes counts;
- refused:    it sends TENSORS to b/stall/0, a stage of site b that is not connected: b's gateway refuses
              each (`unreachable`, as it does once a stage that never reads is full), and each refusal
              crosses back into site a: the most refusals a flood can draw.

With `--starve`, gateway a runs at the lowest priority beside a busy process: its loop falls
behind its I/O threads, which read ahead only `inbound_hwm` messages per connection.

Per scenario: what was sent, what each site's audit log grew by (records and bytes, from just after
the gateways started to just after they stopped, so the summaries written at stop count), gateway
a's status numbers (refusals, rate-limited, dropped, handshakes) and its resident memory (RSS).
tests/integration/test_attack_flood.py runs the same scenarios for a few seconds against stated bounds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import zmq

from nebula.observe.status import read_status
from nebula.security.audit_series import series_files
from nebula.site.process import rss_bytes
from nebula.site.supervisor import Supervisor

SCENARIOS = ("messages", "garbage", "handshakes", "stalled", "stalled-small", "refused")
STAGES = ("a/flood/0", "a/stall/0", "b/sink/0", "b/stall/0")
SMALL, KIB, LARGE = 64, 1 << 10, 256 << 10  # tensor bytes of a flooding message; of one toward a stalled stage


def register(sub) -> None:
    parser = sub.add_parser("flood", help="audit growth and gateway memory under a flood from one stage")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each flood")
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run this scenario (repeatable)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per scenario")
    parser.add_argument("--starve", action="store_true",
                        help="run gateway a at the lowest priority beside a busy process (its loop falls behind)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = []
    if not args.json:
        print(f"{'scenario':<14}{'sent':>9}{'audit a':>11}{'bytes a':>12}{'audit b':>9}{'bytes b':>11}"
              f"{'limited':>9}{'dropped':>9}{'RSS MB':>8}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nebula-flood-") as tmp:
        for name in args.only or SCENARIOS:
            rows.append(flood(name, Path(tmp) / name, args.seconds, starve=args.starve))
            if not args.json:
                _print_row(rows[-1])
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def _print_row(row: dict) -> None:
    a, b, status = row["audit"]["a"], row["audit"]["b"], row["status"]
    print(f"{row['scenario']:<14}{row['sent']:>9}{a['records']:>11}{a['bytes']:>12}{b['records']:>9}"
          f"{b['bytes']:>11}{sum(status.get('rate_limited', {}).values()):>9}"
          f"{sum(status.get('dropped', {}).values()):>9}{row['rss_peak'] / 2**20:>8.0f}", flush=True)
    for site, code in row["exits"].items():
        if code != 0:
            print(f"  gateway {site} exited with {code} (a crash: see its log)", flush=True)


def flood(scenario: str, root: Path, seconds: float, gateway: dict[str, Any] | None = None,
          stop_when: Callable[[int], bool] | None = None, starve: bool = False,
          until_sent: int | None = None) -> dict[str, Any]:
    """Run one scenario on fresh sites under `root` (`gateway`: keys of their [gateway] tables);
    `stop_when(growth of gateway a's RSS)` or `until_sent` messages sent end it early; `starve`: gateway
    a at the lowest priority beside a busy process, so its loop falls behind."""
    with Sites(root, gateway) as sites, starving(sites.procs["a"].pid if starve else None):
        before = {site: audit_size(sites.audit(site)) for site in ("a", "b")}
        peak = [sites.rss("a")]

        def sample(sent: int) -> bool:  # -> stop now
            peak[0] = max(peak[0], sites.rss("a"))
            return (stop_when is not None and stop_when(peak[0] - row["rss_start"])) or \
                (until_sent is not None and sent >= until_sent)

        row = {"scenario": scenario, "seconds": seconds, "rss_start": peak[0]}
        with zmq.Context() as ctx:
            row.update(_FLOODS[scenario](ctx, sites, seconds, sample))
        time.sleep(2.5)  # the gateway writes its status every 2 s: let it show the end of the flood
        row["status"] = sites.status("a")
        row["rss_end"] = sites.rss("a")
        row["exits"] = sites.stop()  # 0 each: a gateway that died in the flood shows here
        row["rss_peak"] = peak[0]
        row["audit"] = {site: {k: v - before[site][k] for k, v in audit_size(sites.audit(site)).items()}
                        for site in ("a", "b")}
        return row


@contextlib.contextmanager
def starving(pid: int | None) -> Iterator[None]:
    """Process `pid` at the lowest CPU priority, and a busy process beside it (None: nothing)."""
    if pid is None:
        yield
        return
    # Linux sets this for the thread whose id is `pid` alone, the main one (the gateway's loop); the
    # I/O threads it started earlier keep their priority and read ahead as fast as ever.
    os.setpriority(os.PRIO_PROCESS, pid, 19)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


class Sites:
    """Sites a and b under `root` (nebula.site.builder), their gateways started as `nebula site up`
    starts them, writing status files; `gateway`: keys of their [gateway] tables."""

    def __init__(self, root: Path, gateway: dict[str, Any] | None = None) -> None:
        # why here: pynacl, kept off `nebula --help`
        from nebula.site.builder import local_sites

        root.mkdir(parents=True, exist_ok=True)
        self.paths = local_sites(root, ("a", "b"), STAGES, gateway={"stats_interval": 0, **(gateway or {})}, days=1)
        self.supervisor = Supervisor(strict=False)

    def __enter__(self) -> Sites:
        # why here: torch (a site's stages), kept off `nebula --help`
        from nebula.site.local import local_services

        try:
            for site, path in self.paths.items():
                spec, = local_services(site, path, restart=False)  # a gateway, no stages
                self.supervisor.start(spec)
                self.supervisor.ready(spec.name)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {site: self.supervisor.services[f"gateway-{site}"].proc for site in self.paths}

    def config(self, site: str):
        # why here: pynacl, kept off `nebula --help`
        from nebula.site.config import load_site_config
        return load_site_config(self.paths[site])

    def audit(self, site: str) -> Path:
        return self.config(site).audit

    def status(self, site: str) -> dict:
        return read_status(self.supervisor.services[f"gateway-{site}"].spec.status_file)

    def rss(self, site: str) -> int:
        return rss_bytes(self.procs[site].pid)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM: each gateway writes its pending summaries and its `gateway.stopped` record;
        -> site -> exit code (0 after a SIGTERM; an abort or a crash before it shows otherwise)."""
        self.supervisor.stop(timeout=15)
        return {name.removeprefix("gateway-"): s.proc.returncode if s.proc else None
                for name, s in self.supervisor.services.items()}


def audit_size(path: Path) -> dict[str, int]:
    """Records and bytes of an audit log series (its archives and live file)."""
    files = series_files(path) if path.exists() else []
    return {"records": sum(f.read_bytes().count(b"\n") for f in files), "bytes": sum(f.stat().st_size for f in files)}


# --- the flooding stage ------------------------------------------------------------------------------
def stage_socket(ctx: zmq.Context, site, address: str, rcvhwm: int = 1000) -> zmq.Socket:
    """A raw DEALER with `address`'s own certificate, connected to its gateway, handshake done."""
    # why here: pynacl, protobuf, kept off `nebula --help`
    from nebula.security.trust import TrustStore, load_identity, peer_curve_key
    from nebula.transport import sockets
    from nebula.transport.routing_id import stage_routing_id
    from nebula.wire import Kind, Message, encode_message

    credentials = site.credentials_for(address)
    sock = sockets.client_socket(ctx, zmq.DEALER, load_identity(credentials, address),
                                 peer_curve_key(TrustStore.load(credentials), site.gateway.address),
                                 hwm=1000, routing_id=stage_routing_id(address))
    sock.rcvhwm = rcvhwm
    monitor = sock.get_monitor_socket(sockets.MONITORED)
    try:
        sock.connect(site.gateway.internal_connect)
        sockets.await_handshake(monitor, address, site.gateway.internal_connect, timeout=10)
        # as a channel does: the gateway sends a stage's messages only to a connection it has heard from
        sock.send_multipart(encode_message(Message(kind=Kind.HEARTBEAT, src=address, dst=site.gateway.address,
                                                   topic="ping")))
    except BaseException:
        sock.close(linger=0)
        raise
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    return sock


def tensors_frames(src: str, dst: str, nbytes: int) -> list[Any]:
    # why here: torch, protobuf, kept off `nebula --help`
    import torch

    from nebula.wire import Kind, Message, TensorPayload, encode_message

    data = torch.zeros(nbytes // 4, dtype=torch.float32)  # (nbytes/4,) float32
    tensor = TensorPayload("hidden", "activation", "float32", tuple(data.shape), "none", b"", [data])
    return encode_message(Message(kind=Kind.TENSORS, job="flood", src=src, dst=dst, tensors=[tensor]))


def pump(sock: zmq.Socket, frames: list[Any], seconds: float, sample: Callable[[int], bool]) -> dict[str, Any]:
    """Send `frames` as fast as `sock` takes them for `seconds` (or until `sample(sent)` says stop),
    reading the replies; -> {"sent", "replies": {error code: count}}."""
    # why here: protobuf, kept off `nebula --help`
    from nebula.wire import parse_envelope

    sent, replies, end, next_sample = 0, Counter(), time.monotonic() + seconds, 0.0
    while time.monotonic() < end:
        for _ in range(64):
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                sock.poll(5, zmq.POLLOUT)
                break
            sent += 1
        while sock.poll(0):
            reply = sock.recv_multipart(copy=False)
            replies[parse_envelope(reply[0]).error.code or "none"] += 1
        if time.monotonic() >= next_sample:
            next_sample = time.monotonic() + 0.1
            if sample(sent):
                break
    return {"sent": sent, "replies": dict(replies)}


def _messages(ctx, sites: Sites, seconds: float, sample) -> dict:
    sink = stage_socket(ctx, sites.config("b"), "b/sink/0")
    received, stop = [0], threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if sink.poll(50):
                while True:
                    try:
                        sink.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    received[0] += 1

    reader = threading.Thread(target=drain, name="flood-sink", daemon=True)
    reader.start()
    try:
        with stage_socket(ctx, sites.config("a"), "a/flood/0") as sock:
            result = pump(sock, tensors_frames("a/flood/0", "b/sink/0", SMALL), seconds, sample)
        time.sleep(0.5)
    finally:
        stop.set()
        reader.join(5)
        sink.close(linger=0)
    return {**result, "received": received[0]}


def _garbage(ctx, sites: Sites, seconds: float, sample) -> dict:
    with stage_socket(ctx, sites.config("a"), "a/flood/0") as sock:
        return pump(sock, [os.urandom(48)], seconds, sample)


def _stalled(ctx, sites: Sites, seconds: float, sample, nbytes: int = LARGE, stage: str = "a/stall/0") -> dict:
    stalled = stage_socket(ctx, sites.config(stage.split("/", 1)[0]), stage, rcvhwm=16)  # connected, never reads
    try:
        with stage_socket(ctx, sites.config("a"), "a/flood/0") as sock:
            return pump(sock, tensors_frames("a/flood/0", stage, nbytes), seconds, sample)
    finally:
        stalled.close(linger=0)


def _stalled_small(ctx, sites: Sites, seconds: float, sample) -> dict:
    return _stalled(ctx, sites, seconds, sample, nbytes=KIB)


def _refused(ctx, sites: Sites, seconds: float, sample) -> dict:
    with stage_socket(ctx, sites.config("a"), "a/flood/0") as sock:
        return pump(sock, tensors_frames("a/flood/0", "b/stall/0", SMALL), seconds, sample)


def _handshakes(ctx, sites: Sites, seconds: float, sample, parallel: int = 16) -> dict:
    """Strangers: each connection a fresh CURVE key; -> {"sent": attempts, "refused": seen refused}."""
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.trust import TrustStore, peer_curve_key

    site = sites.config("a")
    server_key = peer_curve_key(TrustStore.load(site.credentials_for("a/flood/0")), site.gateway.address)
    pending: list[tuple[zmq.Socket, zmq.Socket, float]] = []
    attempts, refused, end, next_sample = 0, 0, time.monotonic() + seconds, 0.0
    while time.monotonic() < end or pending:
        while len(pending) < parallel and time.monotonic() < end:
            public, secret = zmq.curve_keypair()
            sock = ctx.socket(zmq.DEALER)
            sock.linger, sock.curve_publickey, sock.curve_secretkey = 0, public, secret
            sock.curve_serverkey = server_key
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(site.gateway.internal_connect)
            pending.append((sock, monitor, time.monotonic() + 2.0))
            attempts += 1
        zmq.select([m for _, m, _ in pending], [], [], 0.01)
        still = []
        for sock, monitor, deadline in pending:
            done = monitor.poll(0)
            if done:
                refused += monitor.recv_multipart()[0][:2] == zmq.EVENT_HANDSHAKE_FAILED_AUTH.to_bytes(2, "little")
            if done or time.monotonic() > deadline:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
            else:
                still.append((sock, monitor, deadline))
        pending = still
        if time.monotonic() >= next_sample:
            next_sample = time.monotonic() + 0.1
            sample(attempts)
    return {"sent": attempts, "refused": refused}


_FLOODS = {"messages": _messages, "garbage": _garbage, "handshakes": _handshakes, "stalled": _stalled,
           "stalled-small": _stalled_small, "refused": _refused}
