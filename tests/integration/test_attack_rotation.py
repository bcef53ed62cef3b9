"""A peer gateway's key rotation heals the link in either order of rotation and import, whichever side
restarts meanwhile (issue 42, class 1), with real gateway processes and real CURVE.

Site b rotates its gateway key (`nebula keys issue b/gateway/0`: a new key) and restarts its gateway;
site a imports b's new bundle. When b's gateway comes up before a trusts its new key, a's ZAP handler
refuses b's link, and libzmq 4.3.5 never retries a CURVE client after a refusal: before, b -> a stayed
dead after a imported the bundle, and after a restarted too, until b restarted once more. Every order
must end with messages flowing both ways, with no restart beyond the ones the rotation itself needs.
"""
from __future__ import annotations

import time

import pytest

from nebula.site.channel import open_channel
from tests.support.gateways import FAST, GatewayProcess, audit_events, make_world, wait_for
from tests.support.raw_peers import note, notes

# Each step: "rotate" (b issues a new gateway key, published to b's services), "restart-a" / "restart-b"
# (SIGKILL the gateway, start it again: b's comes up with its newest key), "import" (a imports b's bundle).
ORDERS = {
    "rotate, restart b, then import": ["rotate", "restart-b", "import"],
    "rotate, restart b, restart a, then import": ["rotate", "restart-b", "restart-a", "import"],
    "rotate, restart b twice, then import": ["rotate", "restart-b", "restart-b", "import"],
    "rotate, import, then restart b": ["rotate", "import", "restart-b"],
    "rotate, import, restart a, then restart b": ["rotate", "import", "restart-a", "restart-b"],
}
HEAL_S = 20.0  # what a healed link may take: the refused side retries within seconds (PeerLinks)


@pytest.mark.parametrize("order", ORDERS)
def test_a_rotated_peer_gateway_key_ends_with_a_working_link(tmp_path, request, order):
    world = make_world(tmp_path, stages=("a/enc/0", "b/dec/0"))
    a, b = world.site("a"), world.site("b")
    procs = {name: GatewayProcess(world.site(name)).start() for name in ("a", "b")}
    try:
        both_ways(world)  # the link works before
        imported = False
        for step in ORDERS[order]:
            if step == "rotate":
                b.store.issue("b/gateway/0", "gateway", days=2)  # a new key, the newest certificate
                world.publish()
            elif step == "import":
                a.store.trust(b.store.export_bundle().to_dict(), "b.json")
                world.publish()
                imported = True
            else:
                refused = len(external_refusals(a))
                proc = procs[step[-1]]
                proc.kill()
                procs[step[-1]] = GatewayProcess(proc.site).start()
                if step == "restart-b" and not imported:  # b's new key reached a, and a refused it
                    wait_for(lambda n=refused: len(external_refusals(a)) > n, timeout=10, what="a refusing b's key")
                    time.sleep(0.5)  # a audits before it answers: let the refusal reach b before a next step kills a
        both_ways(world)
    finally:
        for proc in procs.values():
            proc.kill()
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            for name, proc in procs.items():
                print(f"--- gateway {name} log ---\n{proc.tail(80)}")


def external_refusals(site) -> list[dict]:
    """The handshakes refused on `site`'s external socket (another site's gateway), as audited in full."""
    return [r for r in audit_events(site.config.audit, "auth.refused") if r["domain"] == "external"]


def both_ways(world) -> None:
    """A note from a/enc/0 reaches b/dec/0 and one from b/dec/0 reaches a/enc/0 (channels opened now,
    so each pins its own gateway's current key)."""
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as enc, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as dec:
        enc.send(note("b/dec/0", 1), timeout=5)
        dec.send(note("a/enc/0", 2), timeout=5)
        assert notes([dec.recv(timeout=HEAL_S)]) == [1], "a -> b"
        assert notes([enc.recv(timeout=HEAL_S)]) == [2], "b -> a"
