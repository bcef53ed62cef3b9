"""Who may complete a CURVE handshake with a gateway: a matrix of good and bad keys, real processes.

Every bad case must end in AuthError on the client within a bounded time (no silent retry loop)
and leave an `auth.refused` record naming the reason in the gateway's audit log.
"""
from __future__ import annotations

import time

import pytest
from nacl.signing import SigningKey

from nebula.errors import AuthError, RemoteError
from nebula.security.keys import curve_keypair
from nebula.security.keystore import SiteKeyStore
from nebula.security.trust import Identity
from nebula.transport.reliable import ReliableChannel
from nebula.wire import Kind, Message
from tests.support.gateways import FAST, GatewayProcess, audit_events, gateway_key, make_world, raw_identity, wait_for

DAY = 86400


@pytest.fixture(scope="module")
def site_a(tmp_path_factory):
    """Site a (gateway running) with stages in every state; site b trusted; site c a stranger."""
    root = tmp_path_factory.mktemp("auth")
    world = make_world(root, stages=("a/enc/0", "a/revoked/0", "b/dec/0"))
    store = world.site("a").store
    store.issue("a/expired/0", "stage", days=1, now=time.time() - 2 * DAY)
    store.issue("a/admin/0", "admin", days=1)
    store.revoke(next(c.serial for c in store.certificates() if c.address == "a/revoked/0"))
    stranger = SiteKeyStore.init(root / "keys", "c")
    cert = stranger.issue("c/enc/0", "stage", days=1)
    # The certificate itself reaches site a (e.g. copied by mistake), but its CA is not trusted there.
    (store.dir / "certs" / f"c.enc.0.{cert.serial:016x}.json").write_text(
        (next((root / "keys" / "c" / "certs").glob("c.enc.0.*.json"))).read_text())
    world.publish()
    gateway = GatewayProcess(world.site("a")).start()
    yield world
    gateway.kill()


def _unlisted(world) -> Identity:
    key = SigningKey.generate()
    return Identity("a/ghost/0", world.site("a").store.certificates()[0], key, *curve_keypair(key))


BAD = {  # case -> (identity factory, reason the audit log must give)
    "unlisted": (_unlisted, "unknown key"),
    "expired": (lambda w: raw_identity(w.site("a").store.dir, "a/expired/0"), "expired"),
    "revoked": (lambda w: raw_identity(w.site("a").store.dir, "a/revoked/0"), "revoked"),
    "wrong-role": (lambda w: raw_identity(w.site("a").store.dir, "a/admin/0"), "role admin not allowed"),
    "wrong-CA": (lambda w: raw_identity(w.root / "keys" / "c", "c/enc/0"), "untrusted CA"),
    # site b shares only its gateway's certificate: its stages are strangers here
    "other-site-stage": (lambda w: raw_identity(w.site("b").store.dir, "b/dec/0"), "unknown key"),
}


def _connect(world, identity: Identity, socket: str = "internal") -> ReliableChannel:
    site = world.site("a")
    endpoint = f"tcp://127.0.0.1:{site.ports[socket]}"
    return ReliableChannel(identity, endpoint, "a/gateway/0", gateway_key(site), FAST)


def test_good_key_is_admitted_and_audited(site_a):
    with _connect(site_a, raw_identity(site_a.site("a").store.dir, "a/enc/0")) as channel:
        channel.send(Message(kind=Kind.CONTROL, dst="a/gateway/0", topic="stats"), timeout=2)
    admitted = audit_events(site_a.site("a").config.audit, "auth.admitted")
    assert any(r["address"] == "a/enc/0" and r["domain"] == "internal" for r in admitted)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_key_is_refused_quickly_and_audited(site_a, case):
    make, reason = BAD[case]
    start = time.monotonic()
    with pytest.raises(AuthError, match="refused by the server's authenticator"):
        _connect(site_a, make(site_a))
    assert time.monotonic() - start < FAST.connect_timeout
    refused = wait_for(lambda: [r for r in audit_events(site_a.site("a").config.audit, "auth.refused")
                                if reason in r["reason"]], what=f"audit of {reason!r}")
    assert refused[0]["domain"] == "internal"


def test_stage_cannot_reach_a_remote_gateway_directly(site_a):
    """A stage of site b that knows site a's public gateway key is refused on a's external socket
    (site b shares only its gateways' certificates), and so is a stage certificate a does know."""
    with pytest.raises(AuthError):
        _connect(site_a, raw_identity(site_a.site("b").store.dir, "b/dec/0"), socket="external")
    with pytest.raises(AuthError):
        _connect(site_a, raw_identity(site_a.site("a").store.dir, "a/enc/0"), socket="external")
    refused = wait_for(lambda: [r for r in audit_events(site_a.site("a").config.audit, "auth.refused")
                                if r["domain"] == "external"], what="external refusals")
    reasons = " | ".join(r["reason"] for r in refused)
    assert "unknown key" in reasons and "role stage not allowed" in reasons


def test_revocation_cuts_a_live_connection_without_restart(site_a):
    store = site_a.site("a").store
    store.issue("a/late/0", "stage", days=1)
    site_a.publish()
    channel = _connect(site_a, raw_identity(store.dir, "a/late/0"))
    try:
        channel.send(Message(kind=Kind.CONTROL, dst="a/gateway/0", topic="stats"), timeout=2)
        store.revoke(next(c.serial for c in store.certificates() if c.address == "a/late/0"))
        site_a.publish()
        with pytest.raises(RemoteError, match="revoked"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the gateway re-reads its trust store within a second
                channel.send(Message(kind=Kind.CONTROL, dst="a/gateway/0", topic="stats"), timeout=2)
                time.sleep(0.2)
    finally:
        channel.close()
    with pytest.raises(AuthError):
        _connect(site_a, raw_identity(store.dir, "a/late/0"))
