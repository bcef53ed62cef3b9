"""Attacks with names and strangers, against real gateways with real CURVE (issue 12, findings 4 and 6).

4. A stage certificate named like a role (`a/gateway/7`, signed before names were reserved) sends an
   ERROR to a stage of site b: its handshake is refused and audited, and b's channel lives on. A peer
   gateway speaks as itself only; a channel fails on an ERROR only from a gateway address it knows.
6. A stage with no link to b's stage writes once, then stays silent: b refuses the message and keeps
   no liveness clock for the stranger, so b's recv() lives on.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import zmq

from nebula.errors import AuthError, ConfigError, RecvTimeout, RemoteError
from nebula.runtime.graph import Graph, LinkConfig
from nebula.site.channel import open_channel
from nebula.transport import sockets
from nebula.transport.routing_id import stage_routing_id
from nebula.wire import Kind, Message, decode_message, encode_message
from tests.support.certs import legacy_certificate
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

QUICK_PEERS = dataclasses.replace(FAST, peer_timeout=1.5)  # a stranger would be "dead" within the test
NO_GATEWAY_TIMEOUT = dataclasses.replace(FAST, gateway_timeout=60.0)  # the fake gateway never answers pings


class RawPeer:
    """A bare CURVE DEALER with a real certificate: it sends what a channel never would, then goes silent."""

    def __init__(self, identity, server_key: bytes, endpoint: str, routing_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = sockets.client_socket(self.ctx, zmq.DEALER, identity, server_key, hwm=100, routing_id=routing_id)
        self.monitor = self.sock.get_monitor_socket(sockets.MONITORED)
        self.endpoint = endpoint
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode_message(msg), copy=False)

    def replies(self, wait: float) -> list[Message]:
        got = []
        while self.sock.poll(int(wait * 1000)):
            got.append(decode_message(self.sock.recv_multipart()))
        return got

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def _forged_error(src: str, dst: str, code: str = "internal") -> Message:
    return Message(kind=Kind.ERROR, src=src, dst=dst, topic=dst, error_code=code,
                   error_message="your gateway failed, give up")


# --- finding 4: names that look like roles ---------------------------------------------------------
def test_role_named_stage_is_refused_and_cannot_kill_another_sites_channel(world, gateways):
    a = world.site("a")
    legacy_certificate(a.store, "a/gateway/7")  # signed by a's CA before the name was reserved
    world.publish()
    with open_channel(a.config, "a/enc/0", config=FAST) as enc, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        enc.send(tensor_message("b/dec/0", 1), timeout=5)
        assert b.recv(timeout=10).step == 1  # the way from a to b is open
        attacker = RawPeer(raw_identity(a.store.dir, "a/gateway/7"), gateway_key(a),
                           f"tcp://127.0.0.1:{a.ports['internal']}", stage_routing_id("a/gateway/7"))
        try:
            attacker.send(_forged_error("a/gateway/7", "b/dec/0"))
            with pytest.raises(RecvTimeout):
                b.recv(timeout=2.0)  # not RemoteError: b's channel never saw the forged error
            with pytest.raises(AuthError, match="refused by the server's authenticator"):
                sockets.await_handshake(attacker.monitor, "a/gateway/7", attacker.endpoint, 3.0)
        finally:
            attacker.close()
        enc.send(tensor_message("b/dec/0", 2), timeout=5)
        assert b.recv(timeout=10).step == 2  # and b's channel still works
    refused = [r for r in audit_events(a.config.audit, "auth.refused") if r["domain"] == "internal"]
    assert refused and refused[-1]["reason"].startswith("reserved name: a/gateway/7")
    assert not [r for r in audit_events(a.config.audit, "auth.admitted") if r["address"] == "a/gateway/7"]
    assert not [r for r in audit_events(world.site("b").config.audit, "transfer.in") if r["src"] == "a/gateway/7"]


def test_a_peer_gateway_speaks_only_as_itself_and_only_as_a_gateway(world):
    """b's gateway (its real certificate on a bare socket, as an older or broken b would) at a's external port."""
    a, b = world.site("a"), world.site("b")
    gateway_a = GatewayProcess(a).start()
    fake_b = RawPeer(raw_identity(b.store.dir, "b/gateway/0"), gateway_key(a),
                     f"tcp://127.0.0.1:{a.ports['external']}", "b/gateway/0")
    try:
        with open_channel(a.config, "a/enc/0", config=FAST) as enc:
            fake_b.send(_forged_error("b/gateway/7", "a/enc/0"))  # another address in a gateway's name
            fake_b.send(Message(kind=Kind.TENSORS, src="b/gateway/0", dst="a/enc/0"))  # a kind gateways never send
            with pytest.raises(RecvTimeout):
                enc.recv(timeout=1.5)
            refused = wait_for(lambda: len(audit_events(a.config.audit, "gateway.refused")) >= 2 and
                               audit_events(a.config.audit, "gateway.refused"), what="two refusals")
            assert [(r["src"], r["code"]) for r in refused] == [("b/gateway/7", "spoof"), ("b/gateway/0", "kind")]
            # b's gateway speaking as itself with a refusal passes a's gateway (it names the gateway), but
            # refuses nothing a/enc/0 sent: its channel drops it (issue 42, class 3; test_attack_channel.py)
            fake_b.send(_forged_error("b/gateway/0", "a/enc/0", code="oversized"))
            with pytest.raises(RecvTimeout):
                enc.recv(timeout=1.5)
            assert enc.stats["unmatched_refusals"] == 1
    finally:
        fake_b.close()
        gateway_a.kill()


def test_a_stage_may_send_a_gateway_only_pings_control_and_acks(world, gateways):
    a = world.site("a")
    stage = RawPeer(raw_identity(a.store.dir, "a/enc/0"), gateway_key(a), f"tcp://127.0.0.1:{a.ports['internal']}",
                    stage_routing_id("a/enc/0"))
    try:
        for dst in ("a/gateway/0", "b/gateway/0"):
            msg = tensor_message(dst, 0)
            msg.src = "a/enc/0"
            stage.send(msg)
            reply = decode_message(stage.sock.recv_multipart()) if stage.sock.poll(5000) else None
            assert reply is not None and reply.kind == Kind.ERROR and reply.error_code == "kind", reply
            assert reply.src == "a/gateway/0" and "HEARTBEAT, CONTROL and ACK" in reply.error_message
    finally:
        stage.close()
    refused = audit_events(a.config.audit, "gateway.refused")
    assert [r["dst"] for r in refused if r["code"] == "kind"] == ["a/gateway/0", "b/gateway/0"]


def test_channel_takes_an_error_as_a_gateway_failure_only_from_a_gateway_it_knows(world):
    """A fake gateway b (its real key; no ZAP handler, so it admits the stage) relays what an older or
    broken gateway would: an ERROR from a stage named like a gateway, then one from site a's gateway."""
    b = world.site("b")
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.linger = 0
    raw_identity(b.store.dir, "b/gateway/0").apply(fake, server=True)
    fake.bind(f"tcp://127.0.0.1:{b.ports['internal']}")
    try:
        with open_channel(b.config, "b/dec/0", config=NO_GATEWAY_TIMEOUT) as dec:
            fake.rcvtimeo = 5000
            routing_id = fake.recv_multipart()[0]  # its first ping: the connection is up
            fake.send_multipart([routing_id, *encode_message(_forged_error("a/gateway/7", "b/dec/0"))], copy=False)
            with pytest.raises(RecvTimeout):
                dec.recv(timeout=1.0)
            assert dec.stats["refused"] == 1
            # Site a's gateway refusing a message dec has in flight to site a: that one fails the channel.
            dec.send(tensor_message("a/enc/0", 1), timeout=5)
            sent = next(m for m in map(decode_message, (fake.recv_multipart()[1:] for _ in range(20)))
                        if m.kind == Kind.TENSORS)
            refusal = _forged_error("a/gateway/0", "b/dec/0", "spoof")
            refusal.topic, refusal.seq, refusal.epoch = "a/enc/0", sent.seq, sent.epoch
            fake.send_multipart([routing_id, *encode_message(refusal)], copy=False)
            with pytest.raises(RemoteError, match=r"\[spoof\].*a/gateway/0 refused"):
                dec.recv(timeout=5)
    finally:
        fake.close(linger=0)
        ctx.term()


# --- finding 6: a stranger's silence -------------------------------------------------------------
@pytest.fixture
def stranger_world(tmp_path):
    return make_world(tmp_path, stages=("a/enc/0", "a/other/0", "b/dec/0"))


def test_a_strangers_silence_does_not_kill_the_receiver(stranger_world, tmp_path):
    world = stranger_world
    a, b = world.site("a"), world.site("b")
    gateways = [GatewayProcess(site).start() for site in (a, b)]
    stranger = None
    try:
        with open_channel(b.config, "b/dec/0", config=QUICK_PEERS, peers={"a/enc/0"}) as dec, \
                open_channel(a.config, "a/enc/0", config=QUICK_PEERS, peers={"b/dec/0"}) as enc:
            enc.send(tensor_message("b/dec/0", 1), timeout=5)
            assert dec.recv(timeout=10).step == 1  # the way from a to b is open
            stranger = RawPeer(raw_identity(a.store.dir, "a/other/0"), gateway_key(a),
                               f"tcp://127.0.0.1:{a.ports['internal']}", stage_routing_id("a/other/0"))
            message = tensor_message("b/dec/0", 7)
            message.src, message.seq, message.epoch = "a/other/0", 1, 1
            stranger.send(message)  # one unsolicited message, then silence
            got, deadline = [], time.monotonic() + 2 * QUICK_PEERS.peer_timeout
            with pytest.raises(RecvTimeout):  # a plain timeout, never "peer a/other/0 has not answered"
                while True:
                    got.append(dec.recv(timeout=max(0.01, deadline - time.monotonic())))
            assert got == []  # nothing from the stranger was delivered
            assert dec.stats["refused"] == 1 and dec.stats["delivered"] == 1
            assert not stranger.replies(0.5)  # no ACK, no ping: b does not talk to strangers
            with pytest.raises(ConfigError, match="no link"):
                dec.send(tensor_message("a/other/0", 0), timeout=1)
            enc.send(tensor_message("b/dec/0", 2), timeout=5)
            assert dec.recv(timeout=10).step == 2  # its peers still get through
        inbound = [r for r in audit_events(b.config.audit, "transfer.in") if r["src"] == "a/other/0"]
        assert len(inbound) == 1  # the stranger's attempt is on record at the receiving site
    finally:
        if stranger is not None:
            stranger.close()
        for gateway in gateways:
            gateway.kill()


def test_without_a_set_of_peers_a_channel_still_hears_anyone(world, gateways):
    """Tools and tests open channels without a job: today's behaviour (anyone may write) stays."""
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as enc, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as dec:
        enc.send(tensor_message("b/dec/0", 3), timeout=5)
        assert dec.recv(timeout=10).step == 3 and dec.stats["refused"] == 0


def test_a_stages_peers_are_its_links_the_coordinator_and_its_inference_ends():
    none = ()
    links = [LinkConfig("src", "mid", ("h",), True, none), LinkConfig("mid", "sink", ("h",), False, none),
             LinkConfig("side", "sink", ("h",), False, none)]
    graph = Graph(["src", "mid", "sink", "side", "lone"], links, micro_batches=1)
    assert graph.peers("src") == {"mid", "sink", "side", "lone"}  # the coordinator talks to every stage
    assert graph.peers("mid") == {"src", "sink"}
    assert graph.peers("sink") == {"mid", "side", "src"}  # src and side ask it for inference scores
    assert graph.peers("side") == {"sink", "src"}
    assert graph.peers("lone") == {"src"}
