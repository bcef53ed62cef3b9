"""The gateway's audit log under traffic: every tensor message and security event is its own record,
acks and heartbeats become per-interval summaries, and the log rotates with one chain across files.

Real gateways (in threads, to pass them the audit knobs), real CURVE, real reliable channels."""
from __future__ import annotations

import threading

import pytest
import torch

from nebula.security.audit import verify
from nebula.security.audit_series import series_files
from nebula.transport.reliable import open_channel
from nebula.wire import Kind, Message, TensorPayload
from services.gateway.server import Gateway
from tests.integration.conftest import FAST, make_world

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
    return [json.loads(line) for f in series_files(world.site(site).config.audit) for line in f.read_text().splitlines()]


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
