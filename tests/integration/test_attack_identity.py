"""Attacks with a legitimate certificate after the handshake (issue 12, findings 1-3), real gateways.

1. A stage of the same site that connects with another stage's routing id gets nothing addressed to
   that stage; the real stage gets its messages while the squatter is connected and after it left.
2. Revocation and expiry reach connections admitted before them, both directions, within seconds.
3. A peer whose gateway certificate is revoked or missing is isolated: the gateway still starts and
   serves its own site and its other peers, and links to the peer once trust is fixed.

Attackers and the stages whose traffic must be watched exactly are bare CURVE DEALERs (`RawDealer`);
everything else is the real channel.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from nebula.site.channel import open_channel
from nebula.transport.routing_id import stage_routing_id
from nebula.wire import Kind, Message
from tests.support.gateways import FAST, audit_events, make_world, wait_for
from tests.support.raw_peers import RawDealer, delivered, note, notes

PATIENT = dataclasses.replace(FAST, peer_timeout=30.0)  # a receiver may be away for seconds on purpose


def audited(where, event: str, **fields) -> list[dict]:
    """The records of `event` in the gateway audit log of site `where` whose fields have these values."""
    return [r for r in audit_events(where.config.audit, event) if all(r.get(k) == v for k, v in fields.items())]


# --- 1. routing-id squatting ----------------------------------------------------------------------
def test_a_squatter_gets_nothing_and_the_real_stage_gets_its_messages(tmp_path, running):
    world = make_world(tmp_path, stages=("a/enc/0", "a/evil/0", "b/dec/0"))
    running(world, "a", "b")
    a = world.site("a")
    # a/evil/0 holds a valid certificate of site a and claims a/enc/0's routing id: as it is, and in the
    # form a real stage uses (with a nonce it had to guess).
    plain = RawDealer(a, "a/evil/0", routing_id="a/enc/0")
    guessed = RawDealer(a, "a/evil/0", routing_id=stage_routing_id("a/enc/0"))
    with open_channel(world.site("b").config, "b/dec/0", config=PATIENT) as sender:
        for n in range(3):
            sender.send(note("a/enc/0", n), timeout=5)
        with open_channel(a.config, "a/enc/0", config=PATIENT) as real:  # while the squatters are connected
            assert notes([real.recv(timeout=10) for _ in range(3)]) == [0, 1, 2]
        assert notes(plain.drain(0.5) + guessed.drain(0.1)) == []

        # What the squatter sends under the stolen id is refused with the reason, and audited.
        plain.send(Message(kind=Kind.CONTROL, src="a/enc/0", dst="b/dec/0", topic="forged"))
        assert plain.recv(kind=Kind.ERROR).error_code == "spoof"
        assert wait_for(lambda: audited(a, "gateway.refused", code="spoof", sender="a/evil/0"), what="audit")

        # The real stage is away, the squatters are still there: its messages wait for it, not for them.
        for n in range(3, 5):
            sender.send(note("a/enc/0", n), timeout=5)
        assert notes(plain.drain(1.5) + guessed.drain(0.1)) == []
        plain.close()
        guessed.close()
        with open_channel(a.config, "a/enc/0", config=PATIENT) as real:  # after they left
            got: list[int] = []  # a new receiver may first get again what the last one did not acknowledge
            while not {3, 4} <= set(got):
                got += notes([real.recv(timeout=10)])
            assert set(got) <= {0, 1, 2, 3, 4}


# --- 2. revocation and expiry reach live connections ------------------------------------------
def _pair(world, receiver: str, sender: str = "b/dec/0") -> tuple[RawDealer, RawDealer]:
    """Bare stages on both sites, each known to its gateway, and one message across that arrives."""
    rx = RawDealer(world.site(receiver.split("/")[0]), receiver)
    tx = RawDealer(world.site(sender.split("/")[0]), sender)
    rx.hello(f"{receiver.split('/')[0]}/gateway/0")
    tx.hello(f"{sender.split('/')[0]}/gateway/0")
    delivered(tx, rx, 0, within=5.0)
    tx.drain(0.2)  # the refusals of its first tries, if any
    return rx, tx


def _serial(store, address: str) -> int:
    return max((c for c in store.certificates() if c.address == address), key=lambda c: c.not_after).serial


def last_arrival(tx: RawDealer, rx: RawDealer, start: float, limit: float = 6.0, quiet: float = 1.5) -> float:
    """Send rx a note every 0.2 s until none has arrived for `quiet` s -> seconds from `start` (monotonic)
    to the last one that arrived (0 if none did)."""
    last, n = start, 100
    while time.monotonic() - start < limit:
        tx.send(note(rx.address, n))
        n += 1
        if notes(rx.drain(0.2)):
            last = time.monotonic()
        elif time.monotonic() - last >= quiet:
            return last - start
    raise AssertionError(f"{rx.address} still receives what is addressed to it {limit} s later")


def test_a_revoked_stage_stops_receiving_and_sending_within_seconds(tmp_path, running):
    world = make_world(tmp_path, stages=("a/victim/0", "b/dec/0"))
    running(world, "a", "b")
    a = world.site("a")
    victim, sender = _pair(world, "a/victim/0")
    try:
        a.store.revoke(_serial(a.store, "a/victim/0"))
        world.publish()
        assert last_arrival(sender, victim, time.monotonic()) < 2.5  # the gateway re-checks every second
        # ... the sender hears why, as a transient error it may retry on (the stage may be reissued)
        assert sender.recv(kind=Kind.ERROR).error_code == "unreachable"
        victim.send(note("b/dec/0", 9))
        assert victim.recv(kind=Kind.ERROR).error_code == "auth"
        assert notes(sender.drain(0.5)) == []
        cut = audited(a, "gateway.cut", address="a/victim/0")
        assert len(cut) == 1 and "revoked" in cut[0]["reason"] and cut[0]["origin"] == "internal"
    finally:
        victim.close()
        sender.close()


def test_an_expired_stage_stops_receiving_without_any_trust_change(tmp_path, running):
    world = make_world(tmp_path, stages=("b/dec/0",))
    a = world.site("a")
    cert = a.store.issue("a/brief/0", "stage", days=6 / 86400)  # six seconds
    world.publish()
    running(world, "a", "b")
    victim, sender = _pair(world, "a/brief/0")
    try:
        expiry = time.monotonic() + cert.not_after - time.time()
        assert last_arrival(sender, victim, expiry, limit=10.0) < 2.5
        cut = audited(a, "gateway.cut", address="a/brief/0")
        assert len(cut) == 1 and "expired" in cut[0]["reason"]
    finally:
        victim.close()
        sender.close()


def test_a_revoked_peer_gateway_carries_nothing_either_way(tmp_path, running):
    world = make_world(tmp_path, stages=("a/enc/0", "b/dec/0"))
    running(world, "a", "b")
    a, b = world.site("a"), world.site("b")
    here, there = _pair(world, "a/enc/0", sender="b/dec/0")
    try:
        delivered(here, there, 1, within=5.0)  # a -> b works before
        here.drain(0.2)
        b.store.revoke(_serial(b.store, "b/gateway/0"))
        a.store.trust(b.store.export_bundle().to_dict(), "b.json")  # the operator imports b's new bundle
        world.publish()
        start = time.monotonic()
        assert last_arrival(here, there, start) < 2.5  # a sends nothing through b's revoked gateway ...
        assert last_arrival(there, here, start) < 2.5  # ... and takes nothing from it
        here.drain(0.2)
        here.send(note("b/dec/0", 2))
        refusal = here.recv(kind=Kind.ERROR)
        assert refusal.error_code == "unreachable" and "isolated" in refusal.error_message
        isolated = audited(a, "gateway.peer_isolated", site="b")
        assert len(isolated) == 1 and "revoked" in isolated[0]["reason"]
        assert audited(a, "gateway.refused", code="auth", src="b/dec/0")  # b's gateway is refused at a
        assert audited(a, "gateway.cut", origin="external", address="b/gateway/0")
    finally:
        here.close()
        there.close()


# --- 3. one bad peer does not take the site down ---------------------------------------------
@pytest.mark.parametrize("case", ["revoked", "missing"])
def test_a_peer_without_a_valid_gateway_is_isolated_not_fatal(tmp_path, running, case):
    world = make_world(tmp_path, names=("a", "b", "c"), stages=("a/enc/0", "a/mate/0", "b/dec/0", "c/dec/0"))
    a, b = world.site("a"), world.site("b")
    if case == "revoked":
        b.store.revoke(_serial(b.store, "b/gateway/0"))
        a.store.trust(b.store.export_bundle().to_dict(), "b.json")
    else:
        (a.store.dir / "trust" / "b.json").unlink()  # site b's bundle never imported
    world.publish()
    running(world, "a", "c")  # site a starts even so ...
    isolated = audited(a, "gateway.peer_isolated", site="b")
    reason = isolated[0]["reason"] if isolated else ""
    assert isolated and ("revoked" in reason if case == "revoked" else "b/gateway/0" in reason)
    # ... and serves its own stages and its other peer
    with open_channel(a.config, "a/enc/0", config=FAST) as enc, \
            open_channel(a.config, "a/mate/0", config=FAST) as mate, \
            open_channel(world.site("c").config, "c/dec/0", config=FAST) as far:
        enc.send(note("a/mate/0", 1), timeout=5)
        enc.send(note("c/dec/0", 2), timeout=5)
        assert notes([mate.recv(timeout=10)]) == [1] and notes([far.recv(timeout=10)]) == [2]

    # Trust fixed (revoked: a new gateway key at b; missing: b's bundle), imported at a: a links to b
    # without a restart. Only the revoked case rotates the key: two valid certificates of one address
    # issued within the same second would leave its clients to pick either.
    if case == "revoked":
        b.store.issue("b/gateway/0", "gateway", days=1)
    a.store.trust(b.store.export_bundle().to_dict(), "b.json")
    world.publish()
    running(world, "b")
    assert wait_for(lambda: audited(a, "gateway.peer_linked", site="b"), timeout=5, what="the link to b")
    with open_channel(a.config, "a/enc/0", config=FAST) as enc, \
            open_channel(b.config, "b/dec/0", config=FAST) as dec:
        enc.send(note("b/dec/0", 3), timeout=5)
        assert notes([dec.recv(timeout=10)]) == [3]
