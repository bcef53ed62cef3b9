"""Site PKI: certificates, revocation, trust bundles and check_peer's refusals, on real key stores."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path

import pytest
import zmq

from nebula.errors import AuthError
from nebula.security.certs import issue_certificate
from nebula.security.credentials import bundle_service
from nebula.security.keys import curve_key_raw, generate_identity
from nebula.security.keystore import DAY, SiteKeyStore
from nebula.security.trust import TrustStore, check_peer, load_identity, peer_curve_key


def creds(store: SiteKeyStore, address: str) -> Path:
    """The service's own credential directory, refreshed from the store (as `nebula site up` does)."""
    out = store.dir.parent / "services" / address.replace("/", ".")
    bundle_service(store.dir, address, out)
    return out


@pytest.fixture
def sites(tmp_path):
    """Sites a and b; a trusts b's bundle (CA key + b's gateway certificate)."""
    a, b = SiteKeyStore.init(tmp_path, "a"), SiteKeyStore.init(tmp_path, "b")
    certs = {
        "a_gw": a.issue("a/gateway/0", "gateway", days=30),
        "a_enc": a.issue("a/encoder/0", "stage", days=30),
        "b_gw": b.issue("b/gateway/0", "gateway", days=30),
    }
    a.trust(b.export_bundle().to_dict(), "b bundle")
    return a, b, certs


def refused(store, cert_or_key, roles, **kw) -> str:
    key = cert_or_key.curve_key_raw if hasattr(cert_or_key, "curve_key_raw") else cert_or_key
    with pytest.raises(AuthError) as info:
        check_peer(store, key, roles, **kw)
    return str(info.value)


def test_valid_certificates_are_admitted_in_their_role(sites):
    a, _, certs = sites
    store = TrustStore.load(a.dir)
    assert check_peer(store, certs["b_gw"].curve_key_raw, {"gateway"}) == certs["b_gw"]
    assert check_peer(store, certs["a_enc"].curve_key_raw, {"stage"}, sites={"a"}).address == "a/encoder/0"


def test_curve_key_is_accepted_raw_z85_or_hex(sites):
    a, _, certs = sites
    store = TrustStore.load(a.dir)
    z85_key = peer_curve_key(store, "b/gateway/0")
    assert len(z85_key) == 40 and curve_key_raw(z85_key) == certs["b_gw"].curve_key_raw
    assert check_peer(store, z85_key, {"gateway"}).serial == certs["b_gw"].serial
    assert check_peer(store, certs["b_gw"].curve_key, {"gateway"}).serial == certs["b_gw"].serial


def test_unknown_key_is_refused(sites):
    a, _, _ = sites
    assert refused(TrustStore.load(a.dir), os.urandom(32), {"gateway"}).startswith("unknown key")


def test_time_window_is_enforced(sites):
    a, _, certs = sites
    store, cert = TrustStore.load(a.dir), certs["a_enc"]
    assert refused(store, cert, {"stage"}, now=cert.not_after).startswith("expired")
    assert refused(store, cert, {"stage"}, now=cert.not_before - 1).startswith("not yet valid")


def test_revoked_serial_is_refused(sites):
    a, _, certs = sites
    a.revoke(certs["a_enc"].serial)
    reason = refused(TrustStore.load(a.dir), certs["a_enc"], {"stage"})
    assert reason.startswith(f"revoked serial {certs['a_enc'].serial}")


def test_role_and_site_restrictions(sites):
    a, _, certs = sites
    store = TrustStore.load(a.dir)
    assert refused(store, certs["a_enc"], {"gateway"}).startswith("role stage not allowed here")
    assert refused(store, certs["b_gw"], {"gateway"}, sites={"a"}).startswith("site b not allowed here")


def test_certificate_from_an_untrusted_ca_is_refused(sites, tmp_path):
    a, _, _ = sites
    c = SiteKeyStore.init(tmp_path, "c")
    c_gw = c.issue("c/gateway/0", "gateway", days=30)
    # Even sitting in a's own certs directory, c's certificate is not trusted: a never imported c's CA.
    (a.dir / "certs" / "c.gateway.0.json").write_text(json.dumps(c_gw.to_dict()))
    assert refused(TrustStore.load(a.dir), c_gw, {"gateway"}).startswith("untrusted CA")


def test_a_ca_cannot_vouch_for_another_sites_address(sites):
    a, b, _ = sites
    forged = issue_certificate(b.ca_secret(), "b", "b/gateway/9", "gateway", generate_identity().verify_key,
                               int(time.time()), int(time.time()) + DAY)
    forged = dataclasses.replace(forged, address="a/gateway/9")
    forged = dataclasses.replace(forged, signature=b.ca_secret().sign(forged.signed_bytes()).signature.hex())
    (a.dir / "certs" / "a.gateway.9.json").write_text(json.dumps(forged.to_dict()))
    assert "cannot vouch for a/gateway/9" in refused(TrustStore.load(a.dir), forged, {"gateway"})


def test_altered_certificate_has_a_bad_signature(sites):
    a, _, certs = sites
    path = next((a.dir / "certs").glob("a.encoder.0.*.json"))
    data = json.loads(path.read_text())
    data["role"] = "gateway"  # a stage trying to pass as a gateway
    path.write_text(json.dumps(data))
    assert refused(TrustStore.load(a.dir), certs["a_enc"], {"gateway"}).startswith("bad signature")


def test_new_certificate_and_revocation_take_effect_on_reload(sites):
    a, _, certs = sites
    store = TrustStore.load(a.dir)
    assert store.reload_if_changed() is False
    new = a.issue("a/decoder/0", "stage", days=30)
    assert refused(store, new, {"stage"}).startswith("unknown key")
    assert store.reload_if_changed() is True
    assert check_peer(store, new.curve_key_raw, {"stage"}) == new
    a.revoke(new.serial)
    assert store.reload_if_changed() is True
    assert refused(store, new, {"stage"}).startswith("revoked serial")
    assert check_peer(store, certs["a_enc"].curve_key_raw, {"stage"}) == certs["a_enc"]


def test_forged_revocation_list_is_refused_and_old_state_kept(sites):
    a, _, certs = sites
    a.revoke(certs["a_enc"].serial)
    store = TrustStore.load(a.dir)
    crl = json.loads((a.dir / "crl.json").read_text())
    crl["revoked"] = []  # un-revoke without the CA key
    (a.dir / "crl.json").write_text(json.dumps(crl))
    with pytest.raises(AuthError, match="bad signature on the revocation list"):
        store.reload_if_changed()
    assert refused(store, certs["a_enc"], {"stage"}).startswith("revoked serial")


def test_renewal_keeps_the_key_and_rotation_replaces_it(sites):
    a, _, certs = sites
    renewed = a.issue("a/encoder/0", "stage", days=60, reuse_key=True)
    assert renewed.curve_key == certs["a_enc"].curve_key and renewed.serial != certs["a_enc"].serial
    a.revoke(certs["a_enc"].serial)  # the old certificate goes; the renewed one still admits the key
    assert check_peer(TrustStore.load(a.dir), renewed.curve_key_raw, {"stage"}) == renewed
    rotated = a.issue("a/encoder/0", "stage", days=30)
    assert rotated.curve_key != renewed.curve_key
    assert load_identity(creds(a, "a/encoder/0"), "a/encoder/0").certificate == rotated


def test_secrets_are_0600_and_readable_secrets_are_refused(sites):
    a, _, _ = sites
    secrets = [a.dir / "ca.key", *(a.dir / "keys").glob("*.key")]
    assert len(secrets) == 3
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in secrets)
    service = creds(a, "a/gateway/0")
    (service / "keys" / "a.gateway.0.key").chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        load_identity(service, "a/gateway/0")
    (a.dir / "ca.key").chmod(0o640)
    with pytest.raises(AuthError, match="group/others can read it"):
        a.issue("a/decoder/0", "stage", days=1)


def test_load_identity_refuses_expired_and_revoked(sites, tmp_path):
    a, _, certs = sites
    identity = load_identity(creds(a, "a/encoder/0"), "a/encoder/0")
    assert identity.certificate == certs["a_enc"]
    assert curve_key_raw(identity.curve_public) == certs["a_enc"].curve_key_raw
    with pytest.raises(AuthError, match="expired"):
        load_identity(creds(a, "a/encoder/0"), "a/encoder/0", now=certs["a_enc"].not_after + 1)
    a.revoke(certs["a_enc"].serial)
    with pytest.raises(AuthError, match="revoked serial"):
        load_identity(creds(a, "a/encoder/0"), "a/encoder/0")


def test_bundle_import_checks_signatures_key_changes_and_rollback(sites, tmp_path):
    a, b, _ = sites
    tampered = b.export_bundle().to_dict()
    tampered["certs"][0]["role"] = "admin"
    with pytest.raises(AuthError, match="bad signature"):
        a.trust(tampered, "tampered")
    b.revoke(b.certificates()[0].serial)
    a.trust(b.export_bundle().to_dict(), "fresh")  # revocation list #1
    stale = b.export_bundle().to_dict()
    stale["crl"] = None
    with pytest.raises(AuthError, match="older than the imported"):
        a.trust(stale, "stale")
    impostor = SiteKeyStore.init(tmp_path / "elsewhere", "b")
    with pytest.raises(AuthError, match="--replace"):
        a.trust(impostor.export_bundle().to_dict(), "impostor")
    assert a.trust(impostor.export_bundle().to_dict(), "impostor", replace=True).site == "b"
    assert [e["event"] for e in map(json.loads, (a.dir / "audit.jsonl").read_text().splitlines())][-1] == "key.trusted"


def test_derived_curve_keys_work_for_a_real_curve_socket_pair(sites):
    a, _, _ = sites
    server_id = load_identity(creds(a, "a/gateway/0"), "a/gateway/0")
    client_id = load_identity(creds(a, "a/encoder/0"), "a/encoder/0")
    server_key = peer_curve_key(TrustStore.load(a.dir), "a/gateway/0")
    ctx = zmq.Context()
    rep, req, bad = ctx.socket(zmq.REP), ctx.socket(zmq.REQ), ctx.socket(zmq.REQ)
    try:
        for sock in (rep, req, bad):
            sock.linger, sock.rcvtimeo, sock.sndtimeo = 0, 2000, 2000
        server_id.apply(rep, server=True)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        client_id.apply(req, server=False, server_key=server_key)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        assert rep.recv() == b"ping"
        rep.send(b"pong")
        assert req.recv() == b"pong"
        # A client holding the wrong server key never completes the handshake: no plaintext fallback.
        client_id.apply(bad, server=False, server_key=client_id.curve_public)
        bad.rcvtimeo = 300
        bad.connect(f"tcp://127.0.0.1:{port}")
        bad.send(b"ping")
        with pytest.raises(zmq.Again):
            bad.recv()
    finally:
        for sock in (rep, req, bad):
            sock.close(linger=0)
        ctx.term()


def test_malformed_certificate_file_is_an_auth_error_naming_the_field(sites):
    a, _, _ = sites
    path = next((a.dir / "certs").glob("a.encoder.0.*.json"))
    data = json.loads(path.read_text())
    data["curve_key"] = "not hex"
    path.write_text(json.dumps(data))
    with pytest.raises(AuthError, match="malformed field"):
        TrustStore.load(a.dir)
