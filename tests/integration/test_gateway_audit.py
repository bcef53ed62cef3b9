"""The gateway's audit log under traffic: every tensor message and security event is its own record,
acks and heartbeats become per-interval summaries, and the log rotates with one chain across files.

Real gateways (in threads, to pass them the audit knobs), real CURVE, real reliable channels."""
from __future__ import annotations

import threading

import pytest
import torch

from nebula.gateway.server import Gateway
from nebula.security.audit import verify
from nebula.security.audit_series import series_files
from nebula.site.channel import open_channel
from nebula.wire import Kind, Message, TensorPayload
from tests.support.gateways import FAST, make_world

MESSAGES = 30


class Gateways:
    """Both gateways of a two-site world, each running in a thread; stop() closes them once."""

    def __init__(self, world) -> None:
        self.world, self.running = world, []
        for site in world.sites.values():
            gateway = Gateway(site.config, audit_max_bytes=4096, audit_summary_interval=0.5).start()
            thread = threading.Thread(target=gateway.run, name=f"gateway-{site.name}", daemon=True)
            thread.start()
            self.running.append((gateway, thread))

    def stop(self) -> None:
        while self.running:
            gateway, thread = self.running.pop()
            gateway.stop_requested.set()
            thread.join(10)
            gateway.close()  # flushes the last interval's summaries


@pytest.fixture
def gateways(tmp_path):
    started = Gateways(make_world(tmp_path))
    yield started
    started.stop()


def tensor_message(dst: str, step: int) -> Message:
    data = torch.arange(64, dtype=torch.float32) + step
    return Message(kind=Kind.TENSORS, job="job-1", dst=dst, step=step,
                   tensors=[TensorPayload("hidden", "activation", "float32", (64,), "none", b"", [data])])


def audit(world, site: str) -> list[dict]:
    import json
    files = series_files(world.site(site).config.audit)
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_tensors_stay_individual_acks_become_summaries_and_the_log_rotates(gateways):
    world = gateways.world
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        for step in range(MESSAGES):
            a.send(tensor_message("b/dec/0", step), timeout=5)
        assert [b.recv(timeout=10).step for _ in range(MESSAGES)] == list(range(MESSAGES))
    gateways.stop()

    a_log, b_log = audit(world, "a"), audit(world, "b")
    for site in "ab":
        result = verify(world.site(site).config.audit)
        assert result.ok, str(result)
    assert len(series_files(world.site("a").config.audit)) > 1  # rotated at 4 KiB, one chain
    for log in (a_log, b_log):
        assert not [r for r in log if r["event"] in ("transfer.in", "transfer.out")
                    and r["kind"] in ("ACK", "HEARTBEAT")]
        assert [r for r in log if r["event"] == "auth.admitted"]  # security events: one record each
    sent = {r["msg_seq"] for r in a_log if r["event"] == "transfer.out" and r["kind"] == "TENSORS"}
    got = {r["msg_seq"] for r in b_log if r["event"] == "transfer.in" and r["kind"] == "TENSORS"}
    assert len(sent) == len(got) == MESSAGES
    acks_in = [r for r in a_log if r["event"] == "transfer.summary" and r["kind"] == "ACK"]
    acks_out = [r for r in b_log if r["event"] == "transfer.summary" and r["kind"] == "ACK"]
    assert {(r["direction"], r["src"], r["dst"]) for r in acks_in} == {("in", "b/dec/0", "a/enc/0")}
    assert {(r["direction"], r["src"], r["dst"]) for r in acks_out} == {("out", "b/dec/0", "a/enc/0")}
    received = sum(r["messages"] for r in acks_in)
    assert 0 < received <= sum(r["messages"] for r in acks_out)
    assert all(r["bytes"] >= r["messages"] and r["first_ts"] <= r["last_ts"] <= r["ts"] for r in acks_in)


def test_a_gateway_whose_audit_log_fills_up_refuses_traffic_until_it_can_record_it(gateways):
    """A full disk once ended the gateway at its next record, and its restarts at their first. Now it
    stays up and fails closed: it refuses what it cannot record (`audit-unavailable`, which senders
    resend), writes `audit.resumed` with what it lost once the disk has room, and nothing is lost or
    delivered twice. /dev/full answers every write with ENOSPC, as a full disk does."""
    import os
    import time

    from nebula.errors import RecvTimeout
    from nebula.security.audit_series import archive_path, archives
    from tests.support.gateways import wait_for

    world = gateways.world
    gateway = next(g for g, _ in gateways.running if g.site.name == "a")
    path = world.site("a").config.audit
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        a.send(tensor_message("b/dec/0", 0), timeout=5)
        assert b.recv(timeout=10).step == 0
        os.rename(path, archive_path(path, max((n for n, _ in archives(path)), default=0) + 1))
        os.symlink("/dev/full", path)
        for step in range(1, 6):
            a.send(tensor_message("b/dec/0", step), timeout=5)
        wait_for(lambda: gateway.meter.refused["audit-unavailable"] > 0, 10, "a refusal for the full audit log")
        assert "No space left on device" in gateway.audit.down
        got = []
        try:
            got.append(b.recv(timeout=1.5).step)  # the one whose record failed had gone through already
            got.append(b.recv(timeout=1.5).step)
        except RecvTimeout:
            pass
        assert got in ([], [1]), got
        os.unlink(path)  # room on the disk again
        started = time.monotonic()
        got += [b.recv(timeout=15).step for _ in range(5 - len(got))]
        assert got == [1, 2, 3, 4, 5] and gateway.audit.down is None
        assert time.monotonic() - started < 10
    gateways.stop()

    result = verify(path)
    assert result.ok, str(result)
    log = audit(world, "a")
    resumed = [r for r in log if r["event"] == "audit.resumed"]
    assert len(resumed) == 1 and "No space left on device" in resumed[0]["reason"]
    lost = resumed[0]["lost"]
    assert lost.get("gateway.refused", 0) >= 1  # the refusals themselves could not be recorded either
    # every message that went out has its record, or is counted in `lost` (the one that went out as the
    # disk filled, if a transfer record was the first write to fail)
    sent = {r["msg_seq"] for r in log if r["event"] == "transfer.out" and r["kind"] == "TENSORS"}
    assert len(sent) + lost.get("transfer.out", 0) >= 6
