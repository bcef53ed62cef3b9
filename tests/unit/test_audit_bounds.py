"""How large a gateway's audit records can get, whatever a sender puts in its envelopes: the flood
bound of docs/security.md ("Under a flood") is made of these sizes, so the document states what
this test measures."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nebula._proto import nebula_pb2 as pb
from nebula.gateway.records import CLIP, CODEC_CLIP, clip, transfer_fields
from nebula.security.audit import AuditLog
from nebula.wire import DEFAULT_LIMITS, Kind

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
WIDE = "\U0001F600"  # one character, 12 bytes in a record (\ud83d\ude00): the widest there is
MORE = 10_000  # characters beyond the clip: a 5-digit count, as many as a 64 KiB envelope allows
FLOOD_S, RATE, BURST = 20, 1000, 2000  # the bound's example: 20 s at the default rate limit and burst
AUDIT_RATE, AUDIT_BURST = 20, 200  # the defaults of [gateway] audit_transfer_rate and audit_transfer_burst


def record_bytes(tmp_path: Path, env: pb.Envelope, nbytes: int, seq: int) -> int:
    """Bytes of the `transfer.out` line the gateway writes for `env` as record `seq`."""
    path = tmp_path / f"audit-{seq}.jsonl"
    path.write_text(json.dumps({"seq": seq - 1, "hash": "0" * 64}) + "\n")  # the log so far ends at seq - 1
    with AuditLog(path, fsync_interval=None, clock=lambda: 1700000000.1234567) as log:  # 17 digits
        log.append("transfer.out", **transfer_fields(env, nbytes))
    return len(path.read_bytes().splitlines(keepends=True)[-1])


def widest_envelope() -> pb.Envelope:
    """Every string as wide as a record can hold it; dst must be an address (admission parses it),
    src only has to start with the sender's site; codec specs distinct in their first characters."""
    env = pb.Envelope(kind=Kind.TENSORS, job=WIDE * (CLIP + MORE), src="b/" + WIDE * (CLIP + MORE),
                      dst="a/" + "x" * (CLIP + MORE) + "/0", seq=2**64 - 1)
    env.tensors.extend(pb.TensorHeader(codec=f"{i}" + WIDE * (CODEC_CLIP + MORE)) for i in range(9))
    return env


@pytest.mark.parametrize("text", ["a/encoder/0", "x" * (CLIP + MORE), WIDE * (CLIP + MORE), "\x00" * (CLIP + 5)])
def test_a_clipped_string_takes_at_most_its_limit_in_the_record(text):
    kept = clip(text)
    escaped = json.dumps(kept)[1:-1]  # as the record holds it (canonical JSON escapes non-ASCII)
    assert len(escaped) <= CLIP + len(f"...({len(text)} more)")
    assert kept == text or kept.endswith(f"...({len(text) - len(kept.split('...(')[0])} more)")


def test_the_sizes_docs_security_states_are_the_measured_ones(tmp_path):
    short = pb.Envelope(kind=Kind.TENSORS, job="j1", src="a/encoder/0", dst="b/decoder/0", seq=41)
    short.tensors.append(pb.TensorHeader(codec="int8"))
    typical = record_bytes(tmp_path, short, 4_194_473, seq=12_345)
    widest = record_bytes(tmp_path, widest_envelope(), DEFAULT_LIMITS.max_message_bytes, seq=10**18)
    assert widest <= 2048
    text = " ".join(DOC.read_text().split())
    forwarded, records = BURST + RATE * FLOOD_S, AUDIT_BURST + AUDIT_RATE * FLOOD_S  # messages, records per link
    assert f"about {round(typical, -1)} bytes each with short names" in text
    assert f"{widest:,} bytes at most" in text
    assert f"at most {BURST:,} + {RATE:,}·t messages forwarded, and of them at most {AUDIT_BURST} + {AUDIT_RATE}·t " \
           "transfer records per link" in text and forwarded == 22_000
    assert f"For t = {FLOOD_S} s: at most {records:,} transfer records per link" in text
    assert f"{records * widest / 1e6:.1f} MB with the longest names" in text
    assert re.search(rf"\b{RATE:,}/s\b", text) and f"defaults {BURST:,}" in text
