"""Delivery is bound to the authenticated key, not to a routing id (issue 42, class 2), real gateways.

A stage of site a holding its own valid certificate (a/evil/0) connects with a/enc/0's exact routing id,
secret included (as if it leaked): the gateway's internal ROUTER once handed that id over to the newest
connection, and the gateway sent a/enc/0's messages to whoever held it. Now a/enc/0's messages go only
to the connection that proved a/enc/0's key, for as long as that connection lasts: the squatter gets
nothing whether it connects while a/enc/0 is connected or after a/enc/0 left, and what it sends under
the stolen id is never forwarded: ignored while the victim holds the id, refused (`spoof`) and
audited once the squatter holds it.
"""
from __future__ import annotations

import time

import pytest

from nebula.wire import Kind
from tests.support.gateways import audit_events, make_world, wait_for
from tests.support.raw_peers import RawDealer, delivered, note, notes

STAGES = ("a/enc/0", "a/evil/0", "b/dec/0")


@pytest.fixture
def sites(tmp_path, running):
    """Sites a and b with STAGES, their real gateways running (the integration conftest's `running`)."""
    world = make_world(tmp_path, stages=STAGES)
    running(world, "a", "b")
    return world


def send_notes(sender: RawDealer, dst: str, numbers: range) -> None:
    for n in numbers:
        sender.send(note(dst, n))


def known(world, address: str, routing_id: str | None = None) -> RawDealer:
    """A bare stage that has pinged its gateway (the gateway sends a stage nothing before it spoke)."""
    stage = RawDealer(world.site(address[0]), address, routing_id=routing_id)
    stage.hello(f"{address[0]}/gateway/0")
    return stage


def refused_spoof(world) -> list[dict]:
    return [r for r in audit_events(world.site("a").config.audit, "gateway.refused")
            if r["code"] == "spoof" and r["sender"] == "a/evil/0"]


def test_a_second_connection_with_the_victims_exact_routing_id_gets_nothing_while_the_victim_is_on(sites):
    victim = known(sites, "a/enc/0")
    routing_id = bytes(victim.sock.routing_id).decode()  # leaked, secret and all
    sender = known(sites, "b/dec/0")
    squatter = None
    try:
        delivered(sender, victim, 0)
        squatter = RawDealer(sites.site("a"), "a/evil/0", routing_id=routing_id)  # its own valid key
        time.sleep(0.3)  # its handshake is done: libzmq has seen the claim
        send_notes(sender, "a/enc/0", range(1, 4))
        assert notes(squatter.drain(1.0)) == []
        assert notes(victim.drain(0.5)) == [1, 2, 3]  # the victim kept its connection and its messages

        # While the victim holds the id, the squatter's connection is ignored: never read, never written.
        squatter.send(note("b/dec/0", 9))
        assert notes(sender.drain(0.5)) == []
        send_notes(sender, "a/enc/0", range(4, 6))
        assert notes(victim.drain(0.5)) == [4, 5] and notes(squatter.drain(0.3)) == []
    finally:
        for stage in (victim, sender, squatter):
            if stage is not None:
                stage.close()


def test_a_connection_that_takes_the_id_of_a_victim_that_left_gets_nothing(sites):
    victim = known(sites, "a/enc/0")
    routing_id = bytes(victim.sock.routing_id).decode()
    sender = known(sites, "b/dec/0")
    squatter = None
    try:
        delivered(sender, victim, 0)
        victim.close()  # its connection ends; the id is free for whoever presents it next
        squatter = RawDealer(sites.site("a"), "a/evil/0", routing_id=routing_id)
        time.sleep(0.3)
        send_notes(sender, "a/enc/0", range(1, 4))
        assert notes(squatter.drain(1.0)) == []  # the address is bound to the key, not to the id
        refusals = sender.drain(0.5)  # the sender hears that a/enc/0 is not there: it resends later
        assert {m.error_code for m in refusals if m.kind == Kind.ERROR} == {"unreachable"}

        squatter.send(note("b/dec/0", 9))
        assert squatter.recv(kind=Kind.ERROR).error_code == "spoof"
        assert wait_for(lambda: refused_spoof(sites), what="the squatter's message refused")

        victim = known(sites, "a/enc/0")  # the real stage again, on a new connection: its messages are its own
        send_notes(sender, "a/enc/0", range(4, 6))
        assert notes(victim.drain(1.0)) == [4, 5]
        assert notes(squatter.drain(0.3)) == []
    finally:
        for stage in (victim, sender, squatter):
            if stage is not None:
                stage.close()
