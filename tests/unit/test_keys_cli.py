"""`nebula keys` and `nebula audit` end to end through nebula.cli.main, in a temporary directory."""
from __future__ import annotations

import dataclasses
import json

import pytest

from nebula import cli
from nebula.security.trust import TrustStore, check_peer


@pytest.fixture
def nebula(monkeypatch, tmp_path, capsys):
    """Run `nebula ARGS` in tmp_path; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    # Only the commands under test: the dispatcher is real, other helpers' commands are not loaded.
    monkeypatch.setattr(cli, "COMMANDS", ["keys", "audit"])

    def run(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def test_two_sites_exchange_trust_issue_list_revoke_and_audit(nebula, tmp_path):
    for site in ("a", "b"):
        assert nebula("keys", "init-site", site)[0] == 0
        assert nebula("keys", "issue", f"{site}/gateway/0", "--role", "gateway", "--days", "30")[0] == 0
    code, out, _ = nebula("keys", "issue", "a/encoder/0", "--role", "stage", "--days", "7")
    serial = out.split("serial ")[1].split()[0]
    assert code == 0
    code, out, _ = nebula("keys", "export", "--site", "b", "--out", "b.bundle.json")
    assert code == 0 and "b/gateway/0" in out
    code, out, _ = nebula("keys", "trust", "--site", "a", "b.bundle.json")
    assert code == 0 and "trusting site b CA sha256:" in out

    b_gateway = json.loads((tmp_path / "b.bundle.json").read_text())["certs"][0]
    store = TrustStore.load(tmp_path / "keys" / "a")
    assert check_peer(store, bytes.fromhex(b_gateway["curve_key"]), {"gateway"}).address == "b/gateway/0"

    assert nebula("keys", "revoke", serial, "--site", "a")[0] == 0
    code, out, _ = nebula("keys", "list", "--site", "a")
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines()[1:]}
    assert code == 0 and rows == {"a/encoder/0": "revoked", "a/gateway/0": "valid", "b/gateway/0": "valid"}

    log = str(tmp_path / "keys" / "a" / "audit.jsonl")
    code, out, _ = nebula("audit", "verify", log)
    assert code == 0 and out.startswith(f"{log}: ok: 5 records")  # ca_created, 2 issued, trusted, revoked
    code, out, _ = nebula("audit", "show", log, "--tail", "1")
    assert code == 0 and "key.revoked" in out and len(out.splitlines()) == 1


def test_tampered_audit_log_fails_verify_naming_the_line(nebula, tmp_path):
    nebula("keys", "init-site", "a")
    nebula("keys", "issue", "a/gateway/0", "--role", "gateway", "--days", "1")
    log = tmp_path / "keys" / "a" / "audit.jsonl"
    code, out, _ = nebula("audit", "verify", str(log))
    anchor = out.splitlines()[1].removeprefix("anchor: ")
    log.write_text(log.read_text().replace('"role":"gateway"', '"role":"admin"'))
    code, out, _ = nebula("audit", "verify", str(log))
    assert code == 1 and "line 2 (seq 2): hash mismatch" in out
    log.write_text(log.read_text().splitlines(keepends=True)[0])
    assert nebula("audit", "verify", str(log))[0] == 0
    code, out, _ = nebula("audit", "verify", str(log), "--anchor", anchor)
    assert code == 1 and "removed from the end" in out


@pytest.mark.parametrize("args, message", [
    (("keys", "issue", "gateway-without-site", "--role", "gateway", "--days", "1"), "not site/stage/rank"),
    (("keys", "issue", "a/gateway/0", "--role", "gateway", "--days", "1"), "init-site a"),
    (("keys", "list"), "holds 0 site key stores"),
    (("audit", "verify", "--anchor", "12", "x.jsonl"), "not SEQ:HASH"),
])
def test_bad_input_exits_2_with_a_message_that_says_what_to_do(nebula, args, message):
    code, _, err = nebula(*args)
    assert code == 2 and message in err


def test_refusals_on_an_existing_site(nebula, tmp_path):
    nebula("keys", "init-site", "a")
    code, _, err = nebula("keys", "init-site", "a")
    assert code == 2 and "refusing to overwrite" in err
    code, _, err = nebula("keys", "revoke", "12345")
    assert code == 2 and "not a certificate of site a" in err
    (tmp_path / "junk.json").write_text("{}")
    code, _, err = nebula("keys", "trust", "junk.json")
    assert code == 2 and "neither a trust bundle nor a CA public key" in err


def test_list_status_checks_the_signature_and_issuer_as_admission_does(nebula, tmp_path):
    """A certificate whose signature is forged, or that another CA signed while naming site a's CA,
    is never admitted: `keys list` must not show it as valid."""
    from nebula.security.certs import Certificate, certificate_filename, issue_certificate
    from nebula.security.keyfile import write_json
    from nebula.security.keys import generate_identity
    from nebula.security.keystore import SiteKeyStore

    for site in ("a", "b"):
        nebula("keys", "init-site", site)
        nebula("keys", "issue", f"{site}/gateway/0", "--role", "gateway", "--days", "30")
    nebula("keys", "export", "--site", "b", "--out", "b.bundle.json")
    nebula("keys", "trust", "--site", "a", "b.bundle.json")
    store, b = SiteKeyStore.open(tmp_path / "keys", "a"), SiteKeyStore.open(tmp_path / "keys", "b")
    (genuine,) = store.certificates()
    now = int(genuine.not_before)
    # The genuine certificate with its role changed after signing: the signature no longer covers it.
    forged = Certificate.from_dict({**genuine.to_dict(), "address": "a/forged/0", "role": "admin"})
    # Signed by a stranger's CA, claiming to be from site a's CA.
    stranger = issue_certificate(generate_identity(), "a", "a/stranger/0", "stage", generate_identity().verify_key,
                                 now, now + 86400, serial=7)
    stranger = Certificate.from_dict({**stranger.to_dict(), "issuer": genuine.to_dict()["issuer"]})
    # Signed by site b's CA, which site a trusts, for an address of site a.
    unsigned = dataclasses.replace(b.certificates()[0], address="a/imposter/0", role="stage", signature="")
    imposter = dataclasses.replace(unsigned, signature=b.ca_secret().sign(unsigned.signed_bytes()).signature.hex())
    for cert in (forged, stranger, imposter):
        write_json(store.dir / "certs" / certificate_filename(cert.address, cert.serial), cert.to_dict())

    code, out, _ = nebula("keys", "list", "--site", "a")
    rows = {line.split()[0]: " ".join(line.split()[5:]) for line in out.splitlines()[1:]}
    assert code == 0
    assert rows == {"a/gateway/0": "valid", "b/gateway/0": "valid", "a/forged/0": "bad signature",
                    "a/stranger/0": "bad signature", "a/imposter/0": "untrusted CA"}
