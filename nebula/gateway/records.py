"""What a gateway's audit records keep of a message (docs/protocol.md §6.4).

Strings in an envelope are the sender's choice: each is clipped, so a record's size is bounded
whatever the sender puts there (docs/security.md, "Under a flood").
"""
from __future__ import annotations

import json

from nebula._proto import nebula_pb2 as pb
from nebula.wire import Kind

CLIP = 256  # bytes a sender-chosen string (an address, a job id, a reason) takes in an audit record, at most
CODECS, CODEC_CLIP = 8, 64  # codec specs kept per transfer record, and bytes of each


def clip(text: str, limit: int = CLIP) -> str:
    """A sender-chosen string as an audit record keeps it: its longest start that takes at most
    `limit` bytes in the record, then how many characters were left out. A record escapes a
    non-ASCII character to 6 or 12 bytes (canonical JSON), so a limit in characters bounded nothing."""
    keep = min(len(text), limit)  # each character takes one byte at least
    if _width(text[:keep]) > limit:  # wider characters: bisect for the longest start that fits
        lo, hi = 0, keep  # _width(text[:lo]) <= limit < _width(text[:hi])
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _width(text[:mid]) <= limit else (lo, mid)
        keep = lo
    return text if keep == len(text) else f"{text[:keep]}...({len(text) - keep} more)"


def _width(text: str) -> int:
    """Bytes `text` takes inside a record's string (canonical JSON, nebula.security.canonical)."""
    return len(json.dumps(text)) - 2


def transfer_fields(env: pb.Envelope, nbytes: int) -> dict:
    """The fields of a `transfer.in` / `transfer.out` record of a TENSORS, CONTROL or ERROR message."""
    return {"job": clip(env.job), "src": clip(env.src), "dst": clip(env.dst), "kind": Kind(env.kind).name,
            "bytes": nbytes, "msg_seq": env.seq,
            "codecs": sorted({clip(t.codec, CODEC_CLIP) for t in env.tensors})[:CODECS]}


def refusal_key(env: pb.Envelope) -> dict:
    """The key under which a refusal a peer gateway sends as itself is a repeated `transfer.in` (§6.3)."""
    return {"src": clip(env.src), "dst": clip(env.dst), "kind": Kind(env.kind).name}


def refusal_fields(env: pb.Envelope, nbytes: int) -> dict:
    """The other fields of that `transfer.in` record: with `refusal_key`, those of `transfer_fields`."""
    return {"job": clip(env.job), "bytes": nbytes, "msg_seq": env.seq,
            "codecs": sorted({clip(t.codec, CODEC_CLIP) for t in env.tensors})[:CODECS]}


def tally_key(direction: str, env: pb.Envelope) -> dict:
    """The key an ACK or HEARTBEAT is counted under in `transfer.summary` records."""
    return {"direction": direction, "job": clip(env.job), "src": clip(env.src), "dst": clip(env.dst),
            "kind": Kind(env.kind).name}
