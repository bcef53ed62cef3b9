"""`nebula bench transport`: throughput of tensor messages over each path, measured in the same run.

Paths (one row per path and message size):
- zmq-plain: PUSH -> PULL, no encryption, one process (the ceiling ZeroMQ gives on this host);
- curve-direct: the same with CURVE (one encrypted hop);
- curve-gateways: stage process -> gateway a -> gateway b -> stage process, all real processes, CURVE
  on each of the three hops, the reliable channel end to end (seq/ACK/window, checksums);
- wan (root only): the same as curve-gateways with each site in its own network namespace, joined by
  a tbf-shaped 60 Mbit/s veth (nebula_lab.wanem); goodput as a fraction of the link rate, next to a plain
  TCP stream over the same link (`tcp_mbit`, the most a single TCP connection gets through tbf);
  with `--rtt-ms 20,80,200`, one such row per round-trip delay added on the link (nebula_lab/delayline.py),
  with the round trip measured on the idle link (`rtt_measured_ms`, median of 5). `fraction_of_link`
  counts every message from the sender's start, so TCP's start-up (several RTTs) is included;
  `steady_fraction_of_link` is the rate the channel keeps once the connection is up: one message's
  bytes over the slope of the arrival times from the second message on (a least-squares line, so a
  constant delay in the pipeline does not count). The first message carries TCP's start-up, and the
  recovery of the drops its overshoot causes holds it back (head-of-line: at 200 ms it arrived 1.5 s
  before the second); a training job pays that once, on one connection that carries every step;
  `resent` counts the messages the channel sent twice (go-back-N), wire time wasted.

Stage processes time the transfer: the sender after a warm-up message was acknowledged, the receiver
at the last message; both read the same host clock.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor
from nebula_lab.wanem import WanError, WanLink, measure_goodput, measure_rtt

MB = 1 << 20
SIZES = (1 * MB, 25 * MB)
COUNTS = {1 * MB: 200, 25 * MB: 12}  # messages per measurement (quick: a quarter)
WAN_MBIT = 60.0
WAN_COUNT = 4  # 25 MB messages over the emulated link (quick: 2)
SITES = ("a", "b")  # point to point: the sender stage at a, the receiver stage at b


def register(sub) -> None:
    parser = sub.add_parser("transport", help="throughput: plain ZeroMQ vs CURVE vs two gateways (and WAN)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per measurement")
    parser.add_argument("--quick", action="store_true", help="fewer messages, one repeat")
    parser.add_argument("--repeat", type=int, default=3, help="repeats per local measurement (median)")
    parser.add_argument("--no-wan", action="store_true", help="skip the emulated WAN measurement")
    parser.add_argument("--wan-only", action="store_true", help="only the emulated WAN measurement(s)")
    parser.add_argument("--rtt-ms", default="0",
                        help="comma-separated round-trip delays to add on the emulated link, one WAN row "
                             "each (default 0: none)")
    parser.add_argument("--messages", type=int, default=None,
                        help=f"25 MB messages per WAN row (default {WAN_COUNT}, quick: {WAN_COUNT // 2})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    repeat = 1 if args.quick else max(1, args.repeat)
    rows, notes = [], []
    emit = (lambda row: None) if args.json else _print_row
    if not args.json:
        print(f"{'path':<16}{'size':>8}{'MB/s':>10}{'vs plain':>10}  notes", flush=True)
    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as tmp:
        for size in () if args.wan_only else SIZES:
            count = COUNTS[size] // (4 if args.quick else 1)
            plain = _median(repeat, lambda size=size, count=count: _direct(size, count, curve=False))
            curve = _median(repeat, lambda size=size, count=count: _direct(size, count, curve=True))
            gateways = _median(repeat, lambda size=size, count=count: _gateways(Path(tmp), size, count))
            for path, mb_s in [("zmq-plain", plain), ("curve-direct", curve), ("curve-gateways", gateways)]:
                rows.append({"path": path, "size_bytes": size, "mb_per_s": round(mb_s, 2),
                             "fraction_of_plain": round(mb_s / plain, 4)})
                emit(rows[-1])
        wan_count = args.messages or WAN_COUNT // (2 if args.quick else 1)
        for rtt_ms in () if args.no_wan else [float(ms) for ms in args.rtt_ms.split(",")]:
            wan = _wan(Path(tmp), 25 * MB, wan_count, notes, rtt_ms)
            if wan:
                rows.append(wan)
                emit(wan)
    if args.json:
        print(json.dumps(rows, indent=1))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _print_row(row: dict) -> None:
    extra = ""
    if row["path"] == "wan":
        steady = row["steady_fraction_of_link"]
        extra = (f"{row['fraction_of_link']:.1%} of {row['link_mbit']:.0f} Mbit/s, RTT {row['rtt_measured_ms']:.0f} ms "
                 f"(plain TCP on the same link: {row['tcp_mbit']:.1f} Mbit/s)"
                 + ("" if steady is None else f"; after the first message: {steady:.1%}"))
    plain = f"{row['fraction_of_plain']:.1%}" if "fraction_of_plain" in row else "-"
    print(f"{row['path']:<16}{row['size_bytes'] // MB:>6}MB{row['mb_per_s']:>10.1f}{plain:>10}  {extra}", flush=True)


def _median(repeat: int, measure) -> float:
    return statistics.median(measure() for _ in range(repeat))


# --- one hop, no gateway ----------------------------------------------------------------------
def _direct(size: int, count: int, curve: bool) -> float:
    """PUSH -> PULL over loopback TCP, sender in a thread; MB/s of payload."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for sock in (pull, push):
            sock.linger, sock.sndhwm, sock.rcvhwm = 0, 1000, 1000
        if curve:  # throw-away keys: this measures the cipher, not the admission policy
            server_public, server_secret = zmq.curve_keypair()
            pull.curve_server, pull.curve_secretkey, pull.curve_publickey = True, server_secret, server_public
            push.curve_serverkey = server_public
            push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"warm-up")
        pull.recv()
        payload = memoryview(bytearray(size))
        sender = threading.Thread(target=lambda: [push.send(payload, copy=False) for _ in range(count)])
        start = time.perf_counter()
        sender.start()
        for _ in range(count):
            pull.recv(copy=False)
        elapsed = time.perf_counter() - start
        sender.join()
        return size * count / elapsed / 1e6
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


# --- through two gateways ----------------------------------------------------------------------
def _gateways(tmp: Path, size: int, count: int) -> float:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import local_sites

    root = Path(tempfile.mkdtemp(dir=tmp))
    paths = local_sites(root, SITES, [f"{site}/bench/0" for site in SITES], gateway={"stats_interval": 0}, days=1)
    return _stream(paths, size, count, root)["mb_per_s"]


def _stream(paths: dict[str, Path], size: int, count: int, root: Path, wan: WanLink | None = None) -> dict:
    """Gateways a and b (started as `nebula site up` starts them), a receiver stage at b and a sender
    stage at a, each its own process under one supervisor; with `wan`, each in its site's namespace."""
    # why here: torch (a site's stages), kept off `nebula --help`
    from nebula.site.local import local_services

    prefix = {site: tuple(wan.exec_prefix(site)) if wan else () for site in SITES}
    module = (sys.executable, "-m", "nebula_lab.bench.transport")
    with Supervisor() as supervisor:
        for site in SITES:
            supervisor.ready(supervisor.start(*local_services(site, paths[site], wan, restart=False)).name)
        receiver = supervisor.start(ServiceSpec(name="recv", run=root, ready="ready", argv=(
            *prefix["b"], *module, "recv", str(paths["b"]), "b/bench/0", str(count))))
        supervisor.ready("recv")
        sender = supervisor.start(ServiceSpec(name="send", run=root, argv=(
            *prefix["a"], *module, "send", str(paths["a"]), "a/bench/0", "b/bench/0", str(size), str(count))))
        supervisor.run(sender.finished, timeout=600, what="the bench sender")
        supervisor.run(receiver.finished, timeout=60, what="the bench receiver")
    sent = json.loads(sender.log.read_text().strip().splitlines()[-1])
    start = sent["start"]
    arrived = json.loads(receiver.log.read_text().strip().splitlines()[-1])["arrived"]
    end = arrived[-1]
    steady = kept_rate(size, arrived)
    return {"mb_per_s": size * count / (end - start) / 1e6, "seconds": end - start,
            "steady_mb_per_s": steady and steady / 1e6, "resent": sent["resent"],
            "arrivals_s": [round(t - start, 3) for t in arrived]}


def kept_rate(size: int, arrived: list[float]) -> float | None:
    """Bytes per second the path keeps: `size` over the least-squares slope of the arrival times from
    the second message on (a constant delay in the pipeline cancels; the first carries the start-up)."""
    if len(arrived) < 3:
        return None
    return size / statistics.linear_regression(range(len(arrived) - 1), arrived[1:]).slope


# --- over the emulated WAN -----------------------------------------------------------------------
def _wan(tmp: Path, size: int, count: int, notes: list[str], rtt_ms: float = 0.0) -> dict | None:
    if os.geteuid() != 0:
        notes.append("wan skipped: network namespaces need root")
        return None
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.builder import local_sites

    root = Path(tempfile.mkdtemp(dir=tmp))
    try:
        with WanLink(name_prefix=f"nbt{os.getpid()}", rate_mbit=WAN_MBIT, sites=SITES, rtt_ms=rtt_ms) as link:
            rtt_measured = statistics.median(measure_rtt(link, "a", "b"))
            tcp_mbit = measure_goodput(link, 64 * MB, src="a", dst="b")
            # Each gateway listens in its namespace, where the other site's gateway reaches it over the link.
            paths = local_sites(root, SITES, [f"{site}/bench/0" for site in SITES], wan=link,
                                gateway={"stats_interval": 0}, days=1)
            result = _stream(paths, size, count, root, link)
    except WanError as exc:
        notes.append(f"wan skipped: {exc}")
        return None
    mbit = result["mb_per_s"] * 8
    return {"path": "wan", "size_bytes": size, "messages": count, "mb_per_s": round(result["mb_per_s"], 3),
            "link_mbit": WAN_MBIT, "rtt_ms": rtt_ms, "rtt_measured_ms": round(rtt_measured, 1),
            "fraction_of_link": round(mbit / WAN_MBIT, 4), "tcp_mbit": round(tcp_mbit, 2),
            "steady_fraction_of_link": None if result["steady_mb_per_s"] is None else
            round(result["steady_mb_per_s"] * 8 / WAN_MBIT, 4),
            "arrivals_s": result["arrivals_s"],  # each message's arrival, from the sender's first send
            "resent": result["resent"],  # messages the channel sent again (go-back-N): wasted wire time
            "fraction_of_tcp": round(mbit / tcp_mbit, 4)}


# --- the stage processes ----------------------------------------------------------------------------
def _stage_send(config: str, address: str, dst: str, size: int, count: int) -> None:
    # why here: torch, pynacl, protobuf, kept off `nebula --help`
    import torch

    from nebula.site.channel import open_channel
    from nebula.site.config import load_site_config
    from nebula.wire import Kind, Message, TensorPayload

    data = torch.zeros(size // 4, dtype=torch.float32)  # (size/4,) float32: `size` bytes on the wire
    with open_channel(load_site_config(config), address) as channel:
        channel.send(Message(kind=Kind.CONTROL, dst=dst, topic="warm-up"), timeout=60)
        channel.flush(60)
        start = time.time()
        for step in range(count):
            tensor = TensorPayload("hidden", "activation", "float32", tuple(data.shape), "none", b"", [data])
            channel.send(Message(kind=Kind.TENSORS, dst=dst, step=step, tensors=[tensor]), timeout=120)
        channel.flush(300)
        resent = channel.stats["resent"]
    print(json.dumps({"start": start, "resent": resent}), flush=True)


def _stage_recv(config: str, address: str, count: int) -> None:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.channel import open_channel
    from nebula.site.config import load_site_config

    with open_channel(load_site_config(config), address) as channel:
        print("ready", flush=True)
        channel.recv(timeout=120)  # warm-up
        arrived = []
        for _ in range(count):
            channel.recv(timeout=300)
            arrived.append(time.time())
    print(json.dumps({"end": arrived[-1], "arrived": arrived}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["send"]:
        _stage_send(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif sys.argv[1:2] == ["recv"]:
        _stage_recv(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit("usage: python -m nebula_lab.bench.transport send CONFIG ADDRESS DST SIZE COUNT "
                 "| recv CONFIG ADDRESS COUNT")
