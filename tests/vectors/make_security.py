"""The security and audit conformance vectors (docs/protocol.md §4-6), made by the project's own code
from fixed keys, serials and a fixed clock, so their bytes are reproducible:

    .venv/bin/python -m tests.vectors.make_security     # rewrites tests/vectors/security/ and audit/

tests/unit/test_protocol_security.py fails when the code no longer makes exactly these files, and
checks the code's verdicts on them against `expected.json`. The keys are throwaway: never use them.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from nacl.signing import SigningKey
from zmq.utils import z85

from nebula.security.audit import AuditLog, verify
from nebula.security.bundle import Bundle, ca_public_dict
from nebula.security.certs import Certificate, certificate_filename, issue_certificate
from nebula.security.crl import sign_crl
from nebula.security.keyfile import write_json
from nebula.security.keys import curve_keypair, fingerprint
from nebula.security.keystore import write_signing_key

HERE = Path(__file__).parent
AT = 1700000000  # verdicts are taken at this time (2023-11-14T22:13:20Z)
DAY = 86400
CA = SigningKey(bytes([1]) * 32)  # site a's CA
GATEWAY = SigningKey(bytes([2]) * 32)  # a/gateway/0
ENCODER = SigningKey(bytes([3]) * 32)  # a/encoder/0 and a/encoder/1
STRANGER = SigningKey(bytes([4]) * 32)  # a CA that site a's trust does not hold
VALID_SERIAL = 0x6000000000000001  # 63 bits: a double cannot hold it (it reads ...856)
EXPIRED_SERIAL, REVOKED_SERIAL, STRANGER_SERIAL = 0x1234, 0xABC, 5
PEER_SERIAL = 0x5000000000000003  # b/gateway/0's, as the audit example's admission names it
# The canonical JSON cases: a JSON text -> its canonical form (keys by code point, floats, escapes, 63-bit int;
# a repeated key keeps its last value, §4).
CANONICAL_INPUTS = (
    '{"b": [1.0, 0.1, 1e-05, 1E16, 123.456e5, -0.0, 100, 6917529027641081857], '
    '"é": null, "a": "é😀\\n\\u007f/\\"\\\\", "A": true, "": {"z": [], "y": {}}}',
    '{"ts": 1700000000.125, "n": 0.000123, "big": 1e22, "small": 5e-324}',
    '{"a": 1, "b": {"c": true, "c": false}, "a": 2}',
)
# What a failed audit check's text starts with in Nebula's verifier, per check of docs/protocol.md §6.1 (the
# check is normative, the text is not): how the code's report is named in expected.json.
AUDIT_CHECKS = {"newline": ("record not terminated", "the archive was truncated"), "json": ("not a JSON record",),
                "members": ("not an audit record",), "hash": ("hash mismatch",), "seq": ("expected seq",),
                "prev": ("prev does not match",), "anchor": ("hash differs from the anchor", "log ends at seq"),
                "archive-missing": ("archive missing",), "archive-empty": ("the archive is empty",),
                "live-missing": ("the live file is missing",)}


def audit_check(problem: str) -> str:
    """The §6.1 check a report's text names."""
    return next(check for check, starts in AUDIT_CHECKS.items() if problem.startswith(starts))


def certificates() -> dict[str, Certificate]:
    """The four certificate vectors, by file name."""
    valid = issue_certificate(CA, "a", "a/gateway/0", "gateway", GATEWAY.verify_key,
                              AT - DAY, AT - DAY + 90 * DAY, serial=VALID_SERIAL)
    expired = issue_certificate(CA, "a", "a/encoder/0", "stage", ENCODER.verify_key,
                                AT - 60 * DAY, AT - 30 * DAY, serial=EXPIRED_SERIAL)
    revoked = issue_certificate(CA, "a", "a/encoder/1", "stage", ENCODER.verify_key,
                                AT - DAY, AT + 29 * DAY, serial=REVOKED_SERIAL)
    forged = replace(valid, not_after=valid.not_after + 365 * DAY)  # the CA's signature, on other bytes
    stranger = issue_certificate(STRANGER, "a", "a/gateway/0", "gateway", GATEWAY.verify_key,
                                 AT - DAY, AT + 29 * DAY, serial=STRANGER_SERIAL)
    return {"cert-valid.json": valid, "cert-forged.json": forged, "cert-expired.json": expired,
            "cert-revoked.json": revoked, "cert-other-ca.json": stranger}


def crl():
    return sign_crl(CA, "a", 1, AT - 3600, {REVOKED_SERIAL: AT - 3600})


def bundle() -> Bundle:
    return Bundle("a", CA.verify_key, (certificates()["cert-valid.json"],), crl())


def write_security(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "ca.pub", ca_public_dict("a", CA.verify_key))
    for name, cert in certificates().items():
        write_json(out / name, cert.to_dict())
    write_json(out / "crl.json", crl().to_dict())
    write_json(out / "bundle.json", bundle().to_dict())
    write_signing_key(out / "gateway.key", GATEWAY, "a/gateway/0")
    cases = [{"input": text, "canonical": canonical_text(text)} for text in CANONICAL_INPUTS]
    (out / "canonical.json").write_text(json.dumps(cases, indent=2) + "\n")
    write_json(out / "expected.json", expected_security())


def canonical_text(text: str) -> str:
    from nebula.security.canonical import canonical_json

    return canonical_json(json.loads(text)).decode()


def expected_security() -> dict:
    """What an implementation must decode and decide; verdicts are stated, not computed."""
    certs = certificates()
    public, secret = curve_keypair(GATEWAY)
    verdicts = {"cert-valid.json": "valid", "cert-forged.json": "bad signature", "cert-expired.json": "expired",
                "cert-revoked.json": "revoked", "cert-other-ca.json": "untrusted CA"}
    return {
        "at": AT,
        "ca.pub": {"site": "a", "key": bytes(CA.verify_key).hex(), "fingerprint": fingerprint(CA.verify_key)},
        "certificates": {name: {"verdict": verdicts[name], "address": c.address, "role": c.role, "serial": c.serial,
                                "file_name": certificate_filename(c.address, c.serial),
                                "curve_key_z85": z85.encode(c.curve_key_raw).decode()}
                         for name, c in certs.items()},
        "crl.json": {"verdict": "valid", "number": 1, "revoked": [REVOKED_SERIAL]},
        "bundle.json": {"site": "a", "fingerprint": fingerprint(CA.verify_key), "certs": ["a/gateway/0"],
                        "crl_number": 1},
        "gateway.key": {"owner": "a/gateway/0", "mode": "0600", "identity_key": bytes(GATEWAY.verify_key).hex(),
                        "curve_public_z85": public.decode(), "curve_secret_z85": secret.decode(),
                        "curve_secret_hex": z85.decode(secret).hex()},
    }


class Clock:
    """A clock that advances by `step` seconds per reading: the `ts` of each record is known."""

    def __init__(self, start: float, step: float) -> None:
        self.now, self.step = start, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def write_audit_log(path: Path) -> None:
    """Six records of a gateway's log, in two files: gateway.000001.jsonl (seq 1-3) and gateway.jsonl."""
    split = _split_size(path.parent)
    with AuditLog(path, fsync_interval=None, max_bytes=split, clock=Clock(AT - 0.875, 0.125)) as log:
        _gateway_session(log)


def _split_size(scratch: Path) -> int:
    """The rotation limit that puts records 1-3 in the first file and 4-6 in the second: the larger
    of their sizes (a file rotates when the next record would take it past the limit)."""
    probe = scratch / ".probe.jsonl"
    with AuditLog(probe, fsync_interval=None, clock=Clock(AT - 0.875, 0.125)) as log:
        _gateway_session(log)
    lines = probe.read_bytes().splitlines(keepends=True)
    probe.unlink()
    return max(sum(len(line) for line in lines[:3]), sum(len(line) for line in lines[3:]))


def _gateway_session(log: AuditLog) -> None:
    log.append("gateway.started", address="a/gateway/0", internal="tcp://127.0.0.1:7100",
               external="tcp://0.0.0.0:7101", peers=["b"], isolated=[])
    log.repeated("auth.admitted", {"domain": "external", "peer": "192.0.2.7", "address": "b/gateway/0"},
                 {"role": "gateway", "serial": PEER_SERIAL}, reason="admitted")
    log.append("transfer.out", job="j1", src="a/encoder/0", dst="b/decoder/0", kind="TENSORS", bytes=4194473,
               msg_seq=41, codecs=["int8(block=128)"])
    log.append("transfer.in", job="j1", src="b/decoder/0", dst="a/encoder/0", kind="CONTROL", bytes=212,
               msg_seq=7, codecs=[])
    for _ in range(3):
        log.tally("transfer.summary", 96, direction="in", job="j1", src="b/decoder/0", dst="a/encoder/0", kind="ACK")
    log.flush_summaries()
    log.append("gateway.stopped", address="a/gateway/0",
               stats={"uptime_s": 1.5, "links": {"to:b": {"messages": 1, "bytes": 4194473}},
                      "jobs": {"j1": {"messages": 5, "bytes": 4194973}}, "refused": {}, "dropped": {},
                      "rate_limited": {}, "handshakes": {"admitted": 1, "refused": 0}})


def write_audit(out: Path) -> None:
    """good/: the log; tampered/: the same with record seq 4's bytes changed and its hash recomputed,
    so only the next record's `prev` gives it away."""
    write_audit_log(out / "good" / "gateway.jsonl")
    shutil.copytree(out / "good", out / "tampered", dirs_exist_ok=True)
    live = out / "tampered" / "gateway.jsonl"
    lines = live.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[0])
    assert record["seq"] == 4 and record["event"] == "transfer.in"
    from nebula.security.audit import record_hash

    record["bytes"] = 20
    record["hash"] = record_hash(record)
    lines[0] = json.dumps(record, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
    live.write_bytes(b"".join(lines))
    good, tampered = verify(out / "good" / "gateway.jsonl"), verify(live)
    write_json(out / "expected.json", {
        "good": {"ok": True, "files": ["gateway.000001.jsonl", "gateway.jsonl"], "records": good.records,
                 "head": {"seq": good.head[0], "hash": good.head[1]}},
        "tampered": {"ok": False, "check": audit_check(tampered.problem or ""), "file": "gateway.jsonl", "line": 2,
                     "seq": 5, "problem": "prev does not match the previous record's hash"},
    })
    assert tampered.seq == 5 and tampered.line == 2  # stated above, checked again by the test


def write_all(root: Path) -> None:
    write_security(root / "security")
    write_audit(root / "audit")


if __name__ == "__main__":
    for sub in ("security", "audit"):
        shutil.rmtree(HERE / sub, ignore_errors=True)
    write_all(HERE)
    print(f"wrote {HERE / 'security'} and {HERE / 'audit'}", file=sys.stderr)
