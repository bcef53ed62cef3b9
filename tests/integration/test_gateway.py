"""The gateway as a router: delivery across sites, stats, and refusals that leave it running."""
from __future__ import annotations

import json

import pytest
import torch
import zmq

from nebula.errors import RemoteError
from nebula.site.channel import open_channel
from nebula.transport import sockets
from nebula.transport.routing_id import stage_routing_id
from nebula.wire import Kind, Message, decode_message, encode_message
from tests.support.gateways import (
    FAST,
    GatewayProcess,
    audit_events,
    gateway_key,
    make_world,
    raw_identity,
    tensor_message,
    wait_for,
)

LIMIT = 8 << 20  # the gateways' max_message_bytes in this module


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("routing"), max_message_bytes=LIMIT)


@pytest.fixture(scope="module")
def gateways(world):
    """Shared by this module's tests (each start costs seconds); tests that stop one make their own."""
    procs = {name: GatewayProcess(site).start() for name, site in world.sites.items()}
    yield procs
    for proc in procs.values():
        proc.kill()


@pytest.fixture
def raw_stage(world, gateways):
    """A bare CURVE DEALER with a/enc/0's certificate: to send what a Channel never would."""
    site = world.site("a")
    ctx = zmq.Context()
    sock = sockets.client_socket(ctx, zmq.DEALER, raw_identity(site.store.dir, "a/enc/0"), gateway_key(site),
                                 hwm=100, routing_id=stage_routing_id("a/enc/0"))
    sock.rcvtimeo = 5000
    sock.connect(f"tcp://127.0.0.1:{site.ports['internal']}")
    yield sock
    sock.close(linger=0)
    ctx.term()


def error_reply(sock) -> Message:
    reply = decode_message(sock.recv_multipart())
    assert reply.kind == Kind.ERROR, reply
    return reply


def test_messages_cross_sites_in_order_both_ways(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        for step in range(20):
            a.send(tensor_message("b/dec/0", step), timeout=5)
        got = [b.recv(timeout=10) for _ in range(20)]
        assert [m.step for m in got] == list(range(20))
        assert all(torch.equal(m.tensors[0].parts[0], torch.arange(16.0) + m.step) for m in got)
        assert {m.src for m in got} == {"a/enc/0"}
        b.send(tensor_message("a/enc/0", 99), timeout=5)
        assert a.recv(timeout=10).step == 99
    transfers = audit_events(world.site("a").config.audit, "transfer.out")
    record = next(r for r in transfers if r["kind"] == "TENSORS")
    assert record["job"] == "job-1" and record["codecs"] == ["none"] and record["bytes"] > 64
    assert "hidden" not in json.dumps(record)  # metadata only, never payload or tensor content


def test_stats_request_reports_bytes_per_link_and_job(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST):
        a.send(tensor_message("b/dec/0", 0, n=1000), timeout=5)
        assert a.flush(10)
        a.send(Message(kind=Kind.CONTROL, dst="a/gateway/0", topic="stats"), timeout=5)
        stats = json.loads(wait_for(lambda: _stats_reply(a), what="stats reply").body)
    assert stats["links"]["to:b"]["bytes"] >= 4000
    assert stats["jobs"]["job-1"]["messages"] >= 1


def _stats_reply(channel):
    try:
        msg = channel.recv(timeout=0.5)
    except Exception:
        return None
    return msg if msg.topic == "stats" else None


@pytest.mark.parametrize("frames", [[b"\xff\x00garbage"], [b""], [b"\x08\x07" * 40_000, b"payload"]],
                         ids=["garbage", "empty", "envelope-too-large"])
def test_garbage_is_answered_with_error_and_audited(world, gateways, raw_stage, frames):
    before = len(audit_events(world.site("a").config.audit, "gateway.refused"))
    raw_stage.send_multipart(frames)
    reply = error_reply(raw_stage)
    assert reply.error_code == "wire" and reply.src == "a/gateway/0" and reply.dst == "a/enc/0"
    refused = wait_for(lambda: audit_events(world.site("a").config.audit, "gateway.refused")[before:], what="audit")
    assert refused[0]["code"] == "wire" and refused[0]["sender"] == "a/enc/0"
    _assert_gateway_alive(raw_stage)


def test_spoofed_src_is_refused(world, gateways, raw_stage):
    raw_stage.send_multipart(encode_message(Message(kind=Kind.CONTROL, src="a/other/0", dst="b/dec/0")), copy=False)
    reply = error_reply(raw_stage)
    assert reply.error_code == "spoof" and "a/other/0" in reply.error_message
    assert audit_events(world.site("a").config.audit, "gateway.refused")[-1]["code"] == "spoof"
    assert not [r for r in audit_events(world.site("a").config.audit, "transfer.out") if r["src"] == "a/other/0"]


def test_unroutable_site_is_refused(world, gateways, raw_stage):
    raw_stage.send_multipart(encode_message(Message(kind=Kind.CONTROL, src="a/enc/0", dst="z/dec/0")), copy=False)
    reply = error_reply(raw_stage)
    assert reply.error_code == "unroutable" and "[peers.z]" in reply.error_message


def test_oversized_message_is_refused_and_gateway_keeps_running(world, gateways, raw_stage):
    big = tensor_message("b/dec/0", 0, n=1)
    big.src = "a/enc/0"
    big.tensors[0].parts = [torch.zeros(LIMIT // 4 + 1)]  # one float over the limit
    raw_stage.send_multipart(encode_message(big), copy=False)
    reply = error_reply(raw_stage)
    assert reply.error_code == "oversized"
    assert audit_events(world.site("a").config.audit, "gateway.refused")[-1]["code"] == "oversized"
    _assert_gateway_alive(raw_stage)


def test_a_refusal_reaches_the_channel_as_remote_error(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a:
        a.send(tensor_message("z/dec/0", 0), timeout=5)
        with pytest.raises(RemoteError, match="no route"):
            a.recv(timeout=5)
        with pytest.raises(RemoteError):
            a.send(tensor_message("b/dec/0", 1), timeout=5)


def test_sigterm_shuts_down_cleanly(tmp_path):
    world = make_world(tmp_path)
    gateway = GatewayProcess(world.site("a")).start()
    try:
        assert gateway.terminate() == 0
    finally:
        gateway.kill()
    stopped = audit_events(world.site("a").config.audit, "gateway.stopped")
    assert stopped and stopped[-1]["address"] == "a/gateway/0"


def _assert_gateway_alive(sock) -> None:
    sock.send_multipart(encode_message(Message(kind=Kind.HEARTBEAT, src="a/enc/0", dst="a/gateway/0", topic="ping")),
                        copy=False)
    assert decode_message(sock.recv_multipart()).topic == "pong"
