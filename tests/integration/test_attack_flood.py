"""Issue 12, findings 5 and 7: what one stage holding a valid certificate can make its gateway write
to disk and hold in memory. Real gateway processes with the site defaults, real CURVE; the floods are
nebula_lab.bench.flood's (`nebula bench flood` runs them for 20 s each and prints the same numbers).

Stated bounds, with the defaults (docs/security.md, "Under a flood"):
- a stage's messages: at most `rate_burst` + `rate_limit` x t forwarded (2,000 + 1,000/s), so at most that
  many transfer records, each 1,767 bytes at most (tests/unit/test_audit_bounds.py); the rest is refused
  "rate-limited" and summarised. Here the same limiter at 200 + 100/s: on a loaded host (CI beside training,
  load 8) the flooder saw no "rate-limited" reply in the flood's 3 s at the defaults (gateway a took no more
  than the burst and rate allow), so the limiter was not tested there; `nebula bench flood` measures the defaults;
- refusals and handshakes: per source (and code) per 10 s interval, 5 records in full and one summary;
- memory: what the gateway holds for one next hop that does not read is at most `queue_bytes` (256 MiB).
Every refusal and every handshake decision is still in the audit log: in full, or counted in a summary.
"""
from __future__ import annotations

import json
from pathlib import Path

from nebula_lab.bench.flood import LARGE, flood

SECONDS = 3.0
RATE, BURST = 100, 200  # [gateway] rate_limit and rate_burst of the message flood (the defaults: 1000, 2000)
QUEUE_BYTES = 256 << 20  # the default of [gateway] queue_bytes
TRANSFER_RECORD = 400  # bytes of one transfer record with this test's names (at most 1,767: test_audit_bounds)


def records(root: Path, site: str) -> list[dict]:
    """Site `site`'s audit log, as the flood's sites under `root` wrote it."""
    from nebula.security.audit_series import series_files
    from nebula.site.config import load_site_config
    audit = load_site_config(root / f"site-{site}.toml").audit
    return [json.loads(line) for f in series_files(audit) for line in f.read_text().splitlines()]


def stopped_stats(log: list[dict]) -> dict:
    return next(r for r in log if r["event"] == "gateway.stopped")["stats"]


def counted(log: list[dict], event: str, **match) -> int:
    """Events written in full plus those counted in `<event>.summary` records, for the fields `match`."""
    def fits(r: dict) -> bool:
        return all(r.get(k) == v for k, v in match.items())
    full = sum(1 for r in log if r["event"] == event and fits(r))
    return full + sum(r["suppressed"] for r in log if r["event"] == f"{event}.summary" and fits(r))


def test_a_message_flood_is_capped_before_it_costs_disk(tmp_path):
    row = flood("messages", tmp_path, SECONDS, gateway={"rate_limit": RATE, "rate_burst": BURST})
    assert row["exits"] == {"a": 0, "b": 0}  # both gateways lived through it
    log_a = records(tmp_path, "a")
    forwarded = [r for r in log_a if r["event"] == "transfer.out" and r["kind"] == "TENSORS"]
    # The gateway may still work through what it had received for a moment after the flooder stops.
    assert len(forwarded) <= BURST + RATE * (SECONDS + 2), f"{len(forwarded)} messages forwarded"
    assert row["audit"]["a"]["bytes"] <= (BURST + RATE * (SECONDS + 2)) * TRANSFER_RECORD + 64_000, row["audit"]
    assert row["audit"]["b"]["bytes"] <= (BURST + RATE * (SECONDS + 2)) * TRANSFER_RECORD + 64_000, row["audit"]
    assert row["replies"].get("rate-limited", 0) > 0  # the flooder was told, with an ERROR
    limited = row["status"]["rate_limited"]["a/flood/0"]  # the status numbers show the drops ...
    assert limited > 0
    stats = stopped_stats(log_a)  # ... and every one is in the audit log, in full or in a summary
    assert counted(log_a, "gateway.refused", sender="a/flood/0", code="rate-limited") \
        == stats["rate_limited"]["a/flood/0"] == stats["refused"]["rate-limited"]


def test_garbage_costs_a_few_records_per_interval_and_every_refusal_is_counted(tmp_path):
    row = flood("garbage", tmp_path, SECONDS)
    assert row["exits"] == {"a": 0, "b": 0}  # both gateways lived through it
    assert row["sent"] > 5000
    assert row["audit"]["a"]["bytes"] <= 64_000, row["audit"]
    log_a = records(tmp_path, "a")
    refusals = stopped_stats(log_a)["refused"]
    assert refusals.get("wire", 0) > 1000
    for code, n in refusals.items():
        assert counted(log_a, "gateway.refused", sender="a/flood/0", code=code) == n, code
    summaries = [r for r in log_a if r["event"] == "gateway.refused.summary"]
    assert summaries and all(r["reasons"] and r["first_ts"] <= r["last_ts"] for r in summaries)


def test_handshakes_with_fresh_keys_are_summarised_per_source_address(tmp_path):
    row = flood("handshakes", tmp_path, SECONDS)
    assert row["exits"] == {"a": 0, "b": 0}  # both gateways lived through it
    assert row["refused"] > 300
    assert row["audit"]["a"]["bytes"] <= 32_000, row["audit"]
    log_a = records(tmp_path, "a")
    refused = stopped_stats(log_a)["handshakes"]["refused"]
    assert refused >= row["refused"]  # the gateway counted every refusal the strangers saw ...
    assert counted(log_a, "auth.refused", peer="127.0.0.1", domain="internal") == refused  # ... and audited it
    summary = next(r for r in log_a if r["event"] == "auth.refused.summary")
    assert summary["reason_kind"] == "unknown key" and summary["distinct"] > 1
    assert sum(summary["reasons"].values()) == summary["suppressed"]


def test_a_stage_that_never_reads_costs_its_gateway_bounded_memory(tmp_path):
    """With the gateway's loop starved (behind its I/O threads, as on a busy host), which made this
    test fail now and then in CI: what the I/O threads read ahead counts too (`inbound_hwm`)."""
    slack = 96 << 20  # the interpreter's own growth, inbound messages being handled, allocator slack
    # stop early when over the bound (as the code before the fix was), before the machine runs out of memory
    # until twice the queue bound has been sent (what the test needs), not for a fixed time: starved beside
    # a loaded suite, 6 s once sent only 499 MiB
    row = flood("stalled", tmp_path, 30.0, stop_when=lambda growth: growth > QUEUE_BYTES + 2 * slack, starve=True,
                until_sent=2 * QUEUE_BYTES // LARGE + 64)
    assert row["exits"] == {"a": 0, "b": 0}
    growth = row["rss_peak"] - row["rss_start"]
    assert growth <= QUEUE_BYTES + slack, f"gateway RSS grew by {growth >> 20} MiB"
    sent_bytes = row["sent"] * LARGE
    assert sent_bytes > 2 * QUEUE_BYTES, f"the flood sent only {sent_bytes >> 20} MiB"
    status = row["status"]
    assert status["dropped"].get("internal", 0) > 0  # the status numbers show the drops
    assert max(status["queued_bytes"].values(), default=0) <= QUEUE_BYTES


def test_a_reliable_channel_over_its_rate_limit_slows_down_and_loses_nothing(tmp_path):
    """"rate-limited" is not a failure for a channel: it resends later, as after "unreachable"."""
    import torch

    from nebula.site.channel import open_channel
    from nebula.wire import Kind, Message, TensorPayload
    from nebula_lab.bench.flood import Sites
    from tests.support.gateways import FAST

    def message(step: int) -> Message:
        data = torch.full((16,), float(step))
        return Message(kind=Kind.TENSORS, dst="b/sink/0", step=step,
                       tensors=[TensorPayload("x", "activation", "float32", (16,), "none", b"", [data])])

    with Sites(tmp_path, gateway={"rate_limit": 40, "rate_burst": 10}) as sites:
        with open_channel(sites.config("a"), "a/flood/0", config=FAST) as a, \
                open_channel(sites.config("b"), "b/sink/0", config=FAST) as b:
            for step in range(60):
                a.send(message(step), timeout=20)
            assert [b.recv(timeout=20).step for _ in range(60)] == list(range(60))
            a.flush(20)
        sites.stop()
        log = records(tmp_path, "a")
    assert stopped_stats(log)["rate_limited"]["a/flood/0"] > 0  # it was held back, and caught up


HANG_UP = r"""
import sys, time, zmq
from nebula.security.trust import TrustStore, load_identity, peer_curve_key
from nebula.transport import sockets
from nebula.site.config import load_site_config
from nebula.transport.zap import ZapHandler, internal_policy

site = load_site_config(sys.argv[1])
ctx = zmq.Context()
credentials = site.credentials_for(site.gateway.address)
store = TrustStore.load(credentials)
zap = ZapHandler(ctx, store, {"internal": internal_policy(site.name)}).start()
server = sockets.server_socket(ctx, zmq.ROUTER, load_identity(credentials, site.gateway.address), "internal", hwm=10)
endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
stage = site.credentials_for("a/enc/0")
flooder = sockets.client_socket(ctx, zmq.DEALER, load_identity(stage, "a/enc/0"),
                                peer_curve_key(TrustStore.load(stage), site.gateway.address), hwm=100000)
monitor = flooder.get_monitor_socket(sockets.MONITORED)
flooder.connect(endpoint)
sockets.await_handshake(monitor, "a/enc/0", endpoint, timeout=10)
for _ in range(20000):  # far more than the server's queue takes: its input from this connection stops
    flooder.send(b"x" * 1000, zmq.NOBLOCK)
time.sleep(0.5)
flooder.disable_monitor()
flooder.close(linger=0)  # hang up while the server is not reading
time.sleep(2.5)  # longer than the heartbeat interval (1 s)
print("survived", flush=True)
zap.stop()
server.close(linger=0)
monitor.close(linger=0)
ctx.term()
"""


def test_a_flooder_that_hangs_up_does_not_abort_its_gateway(tmp_path):
    """libzmq 4.3.5 aborts the whole process ("Assertion failed: !_io_error", stream_engine_base.cpp:310)
    when a socket's heartbeat timer fires on a connection whose input stopped on a full queue and whose
    peer then hung up: a flooding stage that disconnects killed its gateway in 2 of 8 runs of
    `nebula bench flood`. Shown on the gateway's server socket alone, in a child process (an abort)."""
    import subprocess
    import sys

    from tests.support.gateways import make_world

    world = make_world(tmp_path)
    child = subprocess.run([sys.executable, "-c", HANG_UP, str(world.site("a").config_path)],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0 and "survived" in child.stdout, child.stderr[-2000:]
