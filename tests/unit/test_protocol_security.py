"""docs/protocol.md §4-6 (canonical JSON, keys and certificates, the audit log) against the code.

Every example block there (`<!-- example: NAME -->` then a fenced block) is regenerated here from the
code and compared; the conformance vectors under tests/vectors/security and tests/vectors/audit are
remade byte for byte (tests/vectors/make_security.py) and the code's verdicts on them checked against
their expected.json; the audit event table is compared with every audit write in the source.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from nacl.signing import VerifyKey
from zmq.utils import z85

from nebula.errors import AuthError
from nebula.security.audit import GENESIS, REPEAT_FIELDS, SUMMARY_FIELDS, record_hash, verify
from nebula.security.bundle import parse_bundle, verify_bundle_certs
from nebula.security.canonical import canonical_json
from nebula.security.certs import Certificate, certificate_filename, verify_certificate
from nebula.security.crl import RevocationList
from nebula.security.keys import curve_keypair, fingerprint
from nebula.security.keystore import read_signing_key
from nebula.security.trust import FAILED_CHECKS, TrustStore, check_certificate
from nebula.transport.zap import external_policy
from tests.vectors import make_security as vectors

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
VECTORS = ROOT / "tests" / "vectors"
SECURITY, AUDIT = VECTORS / "security", VECTORS / "audit"
BLOCK = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```[\w-]*\n(?P<body>.*?)```", re.S)


def doc_blocks() -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text())}


def section(number: int) -> str:
    """The text of docs/protocol.md's section `number` (up to the next `## `)."""
    text = DOC.read_text()
    start = text.index(f"\n## {number}. ")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def vector(name: str) -> str:
    return (SECURITY / name).read_text()


def curve_keys_text() -> str:
    """The key derivations of the example service key, as the doc's `curve-keys` block shows them."""
    public, secret = curve_keypair(vectors.GATEWAY)
    rows = [("ed25519_seed", bytes(vectors.GATEWAY).hex()), ("identity_key", bytes(vectors.GATEWAY.verify_key).hex()),
            ("curve_key (hex)", z85.decode(public).hex()), ("curve_key (z85)", public.decode()),
            ("curve secret (hex)", z85.decode(secret).hex()), ("curve secret (z85)", secret.decode()),
            ("CA key", bytes(vectors.CA.verify_key).hex()), ("CA fingerprint", fingerprint(vectors.CA.verify_key))]
    return "".join(f"{name:<20}{value}\n" for name, value in rows)


def examples() -> dict[str, str]:
    """What each example block of §4-6 must hold, from the code."""
    valid = vectors.certificates()["cert-valid.json"]
    first_input = json.loads(vector("canonical.json"))[0]["input"]
    return {
        "canonical-json-input": first_input + "\n",
        "canonical-json": canonical_json(json.loads(first_input)).decode() + "\n",
        "curve-keys": curve_keys_text(),
        "key-file": vector("gateway.key"),
        "ca-pub": vector("ca.pub"),
        "certificate-signed-bytes": valid.signed_bytes().decode() + "\n",
        "certificate": vector("cert-valid.json"),
        "certificate-file-name": certificate_filename(valid.address, valid.serial) + "\n",
        "crl": vector("crl.json"),
        "bundle": vector("bundle.json"),
        "audit-records": (AUDIT / "good" / "gateway.000001.jsonl").read_text(),
    }


@pytest.mark.parametrize("name", sorted(examples()))
def test_every_example_in_the_spec_is_what_the_code_makes(name):
    blocks = doc_blocks()
    assert name in blocks, f"docs/protocol.md has no <!-- example: {name} --> block"
    assert blocks[name] == examples()[name], f"docs/protocol.md example {name} differs from the code's output"


def test_the_vectors_are_what_the_code_makes_now(tmp_path):
    vectors.write_all(tmp_path)
    for sub in ("security", "audit"):
        made = {p.relative_to(tmp_path): p.read_bytes() for p in sorted((tmp_path / sub).rglob("*")) if p.is_file()}
        kept = {p.relative_to(VECTORS): p.read_bytes() for p in sorted((VECTORS / sub).rglob("*")) if p.is_file()}
        assert made.keys() == kept.keys()
        changed = [str(path) for path in made if made[path] != kept[path]]
        assert not changed, f"{changed} differ: run `python -m tests.vectors.make_security` if the change is meant"


# --- §4 canonical JSON -----------------------------------------------------------------------------
def test_canonical_json_vectors():
    for case in json.loads(vector("canonical.json")):
        assert canonical_json(json.loads(case["input"])).decode() == case["canonical"]
    assert any('"a": 1' in case["input"] and case["canonical"].startswith('{"a":2') for case in
               json.loads(vector("canonical.json"))), "§4: the case of a repeated key, the last value kept"


def test_a_63_bit_serial_read_as_a_double_breaks_the_signature():
    """§4: what the spec says happens to a reader that parses integers as doubles."""
    valid = vectors.certificates()["cert-valid.json"]
    as_double = int(float(valid.serial))
    assert (valid.serial, as_double) == (6917529027641081857, 6917529027641081856)
    assert f"{valid.serial}" in section(4) and f"{as_double}" in section(4)
    with pytest.raises(AuthError, match="bad signature"):
        verify_certificate(Certificate.from_dict({**valid.to_dict(), "serial": as_double}), vectors.CA.verify_key)


# --- §5 keys, certificates, CRL, bundle --------------------------------------------------------------
def test_signature_fingerprint_and_key_derivations_follow_the_stated_rules():
    """Ed25519 over the canonical JSON of every member but `signature`; fingerprint over the raw key;
    the CURVE secret is SHA-512(seed)[:32] clamped; checked with primitives, not the project's helpers."""
    data = json.loads(vector("cert-valid.json"))
    signed = json.dumps({k: v for k, v in data.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    ca_key = VerifyKey(bytes.fromhex(json.loads(vector("ca.pub"))["key"]))
    ca_key.verify(signed.encode(), bytes.fromhex(data["signature"]))
    assert fingerprint(ca_key) == "sha256:" + hashlib.sha256(bytes(ca_key)).hexdigest()[:32]
    seed = bytes.fromhex(json.loads(vector("gateway.key"))["ed25519_seed"])
    secret = bytearray(hashlib.sha512(seed).digest()[:32])
    secret[0] &= 248
    secret[31] = (secret[31] & 127) | 64
    assert bytes(secret).hex() == json.loads(vector("expected.json"))["gateway.key"]["curve_secret_hex"]


def key_store(tmp_path) -> Path:
    """A key store directory made of the vectors: what `TrustStore.load` (admission) reads."""
    store = tmp_path / "a"
    (store / "certs").mkdir(parents=True)
    shutil.copy(SECURITY / "ca.pub", store / "ca.pub")
    shutil.copy(SECURITY / "crl.json", store / "crl.json")
    for path in SECURITY.glob("cert-*.json"):
        shutil.copy(path, store / "certs" / path.name)
    return store


def verdict(store: TrustStore, cert: Certificate, at: int) -> str:
    try:
        check_certificate(store.snapshot, cert, {cert.role}, at)
    except AuthError as exc:
        return next(check for check in FAILED_CHECKS if str(exc).startswith(check))
    return "valid"


def test_certificate_vectors_get_their_expected_verdicts(tmp_path):
    expected = json.loads(vector("expected.json"))
    store = TrustStore.load(key_store(tmp_path))
    ca = parse_bundle(json.loads(vector("ca.pub")), "ca.pub")
    assert {"site": ca.site, "key": bytes(ca.ca_key).hex(), "fingerprint": ca.fingerprint} == expected["ca.pub"]
    for name, want in expected["certificates"].items():
        cert = Certificate.from_dict(json.loads(vector(name)))
        got = {"verdict": verdict(store, cert, expected["at"]), "address": cert.address, "role": cert.role,
               "serial": cert.serial, "file_name": certificate_filename(cert.address, cert.serial),
               "curve_key_z85": z85.encode(cert.curve_key_raw).decode()}
        assert got == want, name


def test_the_own_role_verdict_skips_the_site_check_that_a_socket_applies(tmp_path):
    """§5.7: `nebula keys list` (and the vectors' verdicts) take checks 1-7 in the certificate's role; the
    external socket of site a, which admits only other sites' gateways, refuses the same certificate."""
    store = TrustStore.load(key_store(tmp_path))
    cert = Certificate.from_dict(json.loads(vector("cert-valid.json")))
    assert verdict(store, cert, vectors.AT) == "valid"
    with pytest.raises(AuthError, match="^site a not allowed"):
        check_certificate(store.snapshot, cert, {"gateway"}, vectors.AT, external_policy("a").sites(store))


def test_a_revocation_list_with_a_repeated_serial_keeps_its_last_entry():
    """§5.5: the entry that comes last is kept; the list verifies only when the kept ones were signed."""
    signed = json.loads(vector("crl.json"))
    entry = signed["revoked"][0]
    ca_key = VerifyKey(bytes.fromhex(json.loads(vector("ca.pub"))["key"]))
    earlier = {**entry, "revoked_at": entry["revoked_at"] - 1}
    kept_last = RevocationList.from_dict({**signed, "revoked": [earlier, entry]})
    assert kept_last.revoked == {entry["serial"]: entry["revoked_at"]}
    kept_last.verify(ca_key)
    kept_first = RevocationList.from_dict({**signed, "revoked": [entry, earlier]})
    assert kept_first.revoked == {entry["serial"]: earlier["revoked_at"]}
    with pytest.raises(AuthError, match="bad signature"):
        kept_first.verify(ca_key)


def test_crl_bundle_and_key_file_vectors_decode_to_their_expected_values(tmp_path):
    expected = json.loads(vector("expected.json"))
    ca_key = VerifyKey(bytes.fromhex(expected["ca.pub"]["key"]))
    crl = RevocationList.from_dict(json.loads(vector("crl.json")))
    crl.verify(ca_key)
    assert {"verdict": "valid", "number": crl.number, "revoked": sorted(crl.revoked)} == expected["crl.json"]
    bundle = parse_bundle(json.loads(vector("bundle.json")), "bundle.json")
    verify_bundle_certs(bundle)
    assert {"site": bundle.site, "fingerprint": bundle.fingerprint, "certs": [c.address for c in bundle.certs],
            "crl_number": bundle.crl.number} == expected["bundle.json"]

    key_path = tmp_path / "gateway.key"
    shutil.copy(SECURITY / "gateway.key", key_path)
    key_path.chmod(0o644)
    with pytest.raises(AuthError, match="group/others can read it"):
        read_signing_key(key_path)  # §5: a key file others may read is refused
    key_path.chmod(0o600)
    key = read_signing_key(key_path)
    public, secret = curve_keypair(key)
    want = expected["gateway.key"]
    assert (bytes(key.verify_key).hex(), public.decode(), secret.decode()) == (
        want["identity_key"], want["curve_public_z85"], want["curve_secret_z85"])
    assert json.loads(key_path.read_text())["owner"] == want["owner"]


def test_a_bundle_is_not_signed_only_its_fingerprint_binds_it(tmp_path):
    """§5: anyone may replace a bundle's CA key and recompute its fingerprint; the bundle still parses.
    Only the operator's out-of-band comparison of the fingerprint catches it."""
    data = json.loads(vector("bundle.json"))
    other = vectors.STRANGER.verify_key
    data.update(ca_key=bytes(other).hex(), fingerprint=fingerprint(other), certs=[], crl=None)
    assert parse_bundle(data, "swapped").fingerprint != json.loads(vector("ca.pub"))["fingerprint"]


# --- §6 the audit log ------------------------------------------------------------------------------
def test_audit_vectors_verify_as_expected():
    expected = json.loads((AUDIT / "expected.json").read_text())
    good = verify(AUDIT / "good" / "gateway.jsonl")
    assert good.ok and {"records": good.records, "head": {"seq": good.head[0], "hash": good.head[1]},
                        "files": good.files} == {**{k: expected["good"][k] for k in ("records", "head")},
                                                 "files": len(expected["good"]["files"])}
    bad, want = verify(AUDIT / "tampered" / "gateway.jsonl"), expected["tampered"]
    assert not bad.ok and (bad.file.name, bad.line, bad.seq) == (want["file"], want["line"], want["seq"])
    assert vectors.audit_check(bad.problem) == want["check"] and bad.problem.startswith(want["problem"])


def _edited(line: bytes, **changes) -> bytes:
    record = json.loads(line)
    record.update(changes)
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _rehashed(line: bytes, **changes) -> bytes:
    record = json.loads(line)
    record.update(changes)
    record["hash"] = record_hash(record)
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


# (check, file to change, how) -> (check, file, line, seq) reported; the changes that break two line checks
# at once (hash and seq: `seq` edited without a new hash) show the order of §6.1's table
BREAKS = {
    "newline": ("gateway.jsonl", lambda lines: lines[:-1] + [lines[-1][:-1]], ("gateway.jsonl", 3, None)),
    "json": ("gateway.jsonl", lambda lines: [lines[0], b"{not json\n", *lines[2:]], ("gateway.jsonl", 2, None)),
    "members": ("gateway.000001.jsonl", lambda lines: [lines[0], b'{"seq":2}\n', lines[2]],
                ("gateway.000001.jsonl", 2, 2)),
    "hash": ("gateway.000001.jsonl", lambda lines: [lines[0], _edited(lines[1], seq=9), lines[2]],
             ("gateway.000001.jsonl", 2, 9)),
    "seq": ("gateway.000001.jsonl", lambda lines: [lines[0], _rehashed(lines[1], seq=9), lines[2]],
            ("gateway.000001.jsonl", 2, 9)),
    "prev": ("gateway.jsonl", lambda lines: [_rehashed(lines[0], prev="0" * 64), *lines[1:]], ("gateway.jsonl", 1, 4)),
    "archive-empty": ("gateway.000001.jsonl", lambda lines: [], ("gateway.000001.jsonl", None, None)),
}


@pytest.mark.parametrize("check", [*BREAKS, "archive-missing", "live-missing", "anchor"])
def test_a_broken_log_is_reported_by_the_check_and_place_of_section_6(tmp_path, check):
    shutil.copytree(AUDIT / "good", tmp_path, dirs_exist_ok=True)
    anchor = None
    if check in BREAKS:
        name, change, want = BREAKS[check]
        lines = (tmp_path / name).read_bytes().splitlines(keepends=True)
        (tmp_path / name).write_bytes(b"".join(change(lines)))
    elif check == "archive-missing":
        (tmp_path / "gateway.000001.jsonl").rename(tmp_path / "gateway.000002.jsonl")
        want = ("gateway.000001.jsonl", None, None)
    elif check == "live-missing":
        (tmp_path / "gateway.jsonl").unlink()
        want = ("gateway.jsonl", None, None)
    else:
        anchor, want = (7, "0" * 64), ("gateway.jsonl", None, None)  # a record the log never reached
    report = verify(tmp_path / "gateway.jsonl", anchor=anchor)
    assert not report.ok and vectors.audit_check(report.problem) == check
    assert (report.file.name, report.line, report.seq) == want


def test_the_hash_is_over_the_line_without_its_hash_member():
    """§6: a record's line is its canonical JSON without `hash`, with `,"hash":"<hex>"` before the last brace;
    the hash is SHA-256 of those bytes; `prev` chains from 64 zeros across the files of the series."""
    prev, seq = GENESIS, 0
    for name in ("gateway.000001.jsonl", "gateway.jsonl"):
        for line in (AUDIT / "good" / name).read_bytes().splitlines(keepends=True):
            record = json.loads(line)
            body = line[:-len(b',"hash":"' + record["hash"].encode() + b'"}\n')] + b"}"
            assert body == canonical_json({k: v for k, v in record.items() if k != "hash"})
            assert record["hash"] == hashlib.sha256(body).hexdigest() == record_hash(record)
            assert (record["seq"], record["prev"]) == (seq + 1, prev)
            prev, seq = record["hash"], record["seq"]


def test_the_audit_example_does_not_confuse_record_seq_with_msg_seq():
    records = [json.loads(line) for line in examples()["audit-records"].splitlines()]
    transfer = next(r for r in records if r["event"] == "transfer.out")
    assert transfer["seq"] != transfer["msg_seq"]
    assert f"record `seq` {transfer['seq']}" in section(6) and f"`msg_seq` {transfer['msg_seq']}" in section(6)


# --- the event table -------------------------------------------------------------------------------
WRITERS = ("append", "tally", "repeated", "_audit")


def audit_writes() -> dict[str, set[str]]:
    """Every audit record the source writes: event -> its fields (besides seq, ts, event, prev, hash).
    Found by reading the calls: `<...>audit.append|tally|repeated(EVENT, ...)`, `<...>._audit(EVENT, ...)`,
    `audit(DIR, EVENT, ...)` (nebula.security.accounts.audit) and the log's own `_write_records([(EVENT, ...)])`."""
    trees = [ast.parse(p.read_text()) for p in sorted([*ROOT.glob("nebula/**/*.py"), *ROOT.glob("services/**/*.py")])]
    # module-level functions that build a record's fields: `**transfer_fields(env, n)` has their keys
    builders = {f.name: f for tree in trees for f in tree.body if isinstance(f, ast.FunctionDef)}
    events: dict[str, set[str]] = {}
    for func in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for call in ast.walk(func):
                if isinstance(call, ast.Call):
                    for event, fields in _audit_call(call, func, builders):
                        events.setdefault(event, set()).update(fields)
    return events


def _audit_call(call: ast.Call, func: ast.AST, builders: dict) -> list[tuple[str, set[str]]]:
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "_write_records" and isinstance(call.args[0], ast.List):
        return [(entry.elts[0].value, _dict_keys(entry.elts[1], func, builders))  # `audit.resumed`
                for entry in call.args[0].elts
                if isinstance(entry, ast.Tuple) and isinstance(entry.elts[0], ast.Constant)]
    if isinstance(f, ast.Attribute) and f.attr in WRITERS and (f.attr == "_audit"
                                                               or ast.unparse(f.value).endswith("audit")):
        kind, args = f.attr, call.args
    elif isinstance(f, ast.Name) and f.id == "audit":
        kind, args = "append", call.args[1:]
    else:
        return []
    names = _event_names(args[0]) if args else []
    fields = {k.arg for k in call.keywords if k.arg}
    for k in call.keywords:
        if k.arg is None:  # **{k: v for ... if k in ("a", "b")}, **builder(...)
            fields |= _dict_keys(k.value, func, builders)
    if kind == "tally":
        return [(name, fields | SUMMARY_FIELDS) for name in names]
    if kind == "repeated":
        key = _dict_keys(args[1], func, builders)
        return [(name, key | _dict_keys(args[2], func, builders)) for name in names] + \
               [(f"{name}.summary", key | REPEAT_FIELDS) for name in names]
    return [(name, fields) for name in names]


def _event_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _event_names(node.body) + _event_names(node.orelse)
    if isinstance(node, ast.JoinedStr):  # f"transfer.{direction}": matched against the table by pattern
        return ["".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)]
    return []  # a wrapper passing its own argument on (AuditLog.append inside audit())


def _dict_keys(node: ast.AST, func: ast.AST, builders: dict) -> set[str]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in builders:
        func = builders[node.func.id]  # the dict its `return` builds
        node = next(sub.value for sub in ast.walk(func) if isinstance(sub, ast.Return))
    if isinstance(node, ast.Name):  # a local `fields = {...}`
        for sub in ast.walk(func):
            if isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in sub.targets):
                node = sub.value
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys}
    if isinstance(node, ast.DictComp):
        for cond in node.generators[0].ifs:
            if isinstance(cond, ast.Compare) and isinstance(cond.ops[0], ast.In):
                return {e.value for e in cond.comparators[0].elts}
    raise AssertionError(f"cannot read the fields of an audit write: {ast.unparse(node)}")


def event_table() -> dict[str, set[str]]:
    """§6.4's event tables: event -> fields, from the backticked names of their first two columns."""
    table = {}
    events = section(6)
    for line in events[events.index("### 6.4 Events"):].splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and cells[1].strip().startswith("`"):
            fields = set(re.findall(r"`([\w.]+)`", cells[2]))
            for event in re.findall(r"`([\w.]+)`", cells[1]):
                table[event] = fields
    return table


def table_names(event: str, table: dict, literal: set[str]) -> list[str]:
    """The table's events a written name stands for: itself, or for an f-string (`transfer.*`) every
    name of that shape that no other write names literally."""
    if "*" not in event:
        return [event] if event in table else []
    pattern = re.compile(event.replace(".", r"\.").replace("*", r"\w+"))
    return [name for name in table if pattern.fullmatch(name) and name not in literal]


def test_the_event_table_lists_every_event_the_code_writes_with_its_fields():
    written, table = audit_writes(), event_table()
    assert len(written) > 25  # the scan found the writers (gateway, ZAP handler, key store, accounts, grants, jobs)
    literal = {event for event in written if "*" not in event}
    covered = set()
    for event, fields in written.items():
        names = table_names(event, table, literal)
        assert names, f"{event} is written ({sorted(fields)}) but not in the table of docs/protocol.md §6"
        for name in names:
            assert table[name] == fields, \
                f"{name}: the table says {sorted(table[name])}, the code writes {sorted(fields)}"
        covered.update(names)
    assert not table.keys() - covered, f"the table lists events no code writes: {sorted(table.keys() - covered)}"


def test_the_example_records_have_the_fields_of_the_table():
    table = event_table()
    for path in sorted((AUDIT / "good").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert set(record) - {"seq", "ts", "event", "prev", "hash"} == table[record["event"]], record["event"]
