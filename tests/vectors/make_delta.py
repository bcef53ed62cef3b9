"""The `delta` conformance vectors (tests/vectors/delta/streams.json): one stream of messages, encoded
by a sender and decoded by a receiver that each keep the codec's cache (docs/protocol.md §3.7), with
what each message decodes to or why it is refused, and both caches after it.

    .venv/bin/python -m tests.vectors.make_delta --regenerate    # rewrites tests/vectors/delta/ from the code
    .venv/bin/python -m tests.vectors.make_delta                 # says whether the file differs from the code

The rows are (T, 256) with T = 255: 65,280 float32 elements, so an entry counts 4 x 65,280 + 1,024 =
2^18 bytes and `mb=1` holds exactly four of them; a few rows make an eviction. `topk(1e-05)` keeps one to
three elements per group, so the frames stay small, and the tensors are listed by their non-zero elements.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from nebula.codecs import pack, unpack
from nebula.codecs.delta import fit
from nebula.errors import CodecError
from nebula.wire import decode_message
from tests.vectors.make_wire import frames_of, tensor_bytes, tensors_message, write_or_check

ROOT = Path(__file__).resolve().parent / "delta"
SPEC = "delta(topk(1e-05), mb=1)"
WIDTH = 256

# (ids, T, delivered, about): one message each, in stream order
MESSAGES: list[tuple[list[int], int, bool, str]] = [
    ([101, 102], 255, True, "two first visits: misses, sent direct"),
    ([101, 103], 255, True, "101 is a hit, a delta against message 1's base; 103 a miss. 101 is touched, then "
     "stored: it is the most recently used but for 103, stored after it"),
    ([104, 105], 255, True, "two misses; storing 104 fills the 2^20 bytes exactly (kept), storing 105 goes over: "
     "the least recently used, 102, is evicted"),
    ([102, 101], 256, True, "102 was evicted: a miss again; 101 a hit whose (255, 256) base is extended with a "
     "zero row to (256, 256). Storing 102 (263,168 bytes) evicts 103 and 104; storing 101 again makes it the "
     "most recently used, after 102"),
    ([105], 128, False, "lost on the way: the sender stored 105 as message 5 (a delta against message 3's base, "
     "cut to (128, 256)); the receiver never sees it"),
    ([101, 105], 128, True, "105 names message 5's base, the receiver holds message 3's: the whole message is "
     "refused and the receiver's cache stays as it was (101's delta is not applied either)"),
]


def visit(ids: list[int], rows: int, message: int) -> torch.Tensor:
    """(B, rows, WIDTH) zeros but two elements per example, with magnitudes that differ across the
    examples and messages, so topk never chooses between equal ones."""
    x = torch.zeros(len(ids), rows, WIDTH)
    for i, key in enumerate(ids):
        e = key - 100
        x[i, 0, e] = e + message / 4
        x[i, 1, e + 1] = -(e / 8 + message / 32)
    return x


def sparse(x: torch.Tensor) -> dict[str, Any]:
    """dtype, shape, the elements that are not +0.0 as [row-major index, value], and the SHA-256 of the
    tensor's little-endian bytes (what to compare: signed zeros included)."""
    flat = x.reshape(-1)
    listed = (flat != 0) | torch.signbit(flat)
    return {"dtype": "float32", "shape": list(x.shape),
            "nonzero": [[int(i), float(flat[i])] for i in listed.nonzero().flatten()],
            "sha256": hashlib.sha256(tensor_bytes(x)).hexdigest()}


def cache_listing(state: dict) -> list[list[Any]]:
    """[id, seq, row shape] per entry, least recently used first."""
    held = state["cache"].state_dict()
    return [[key, seq, list(row.shape)] for key, seq, row in zip(held["ids"].tolist(), held["seqs"].tolist(),
                                                                 held["rows"])]


def end(state: dict) -> dict[str, Any]:
    counts = state["cache"].counts
    return {"cache": cache_listing(state), "hits": counts["hits"], "misses": counts["misses"],
            "evictions": counts["evictions"]}


def groups_without_ties(before: dict, ids: list[int], tags: list[int], x: torch.Tensor) -> bool:
    """Whether topk's choice in each group (direct rows; delta rows minus their fitted bases, §3.7) is
    free of equal magnitudes at its boundary: then any encoder makes exactly these frames."""
    direct = [x[i] for i, tag in enumerate(tags) if not tag]
    delta = [x[i] - fit(before[key], tuple(x.shape[1:])) for i, (key, tag) in enumerate(zip(ids, tags)) if tag]
    for rows in (direct, delta):
        if rows:
            magnitudes = torch.stack(rows).abs().reshape(-1).sort(descending=True).values
            k = max(1, round(1e-05 * magnitudes.numel()))
            if k < magnitudes.numel() and magnitudes[k - 1] == magnitudes[k]:
                return False
    return True


def stream() -> dict[str, Any]:
    sender: dict = {}
    receiver: dict = {}
    out = []
    for number, (ids, rows, delivered, about) in enumerate(MESSAGES, start=1):
        x = visit(ids, rows, number)
        before = _rows(sender)
        payload = pack("h", "activation", x, SPEC, state=sender, ids=torch.tensor(ids))
        frames = frames_of(tensors_message(payload, step=number))
        tags = payload.parts[1].tolist()
        assert groups_without_ties(before, ids, tags, x), f"message {number}: topk would choose between equals"
        entry: dict[str, Any] = {"message": number, "about": about, "delivered": delivered, "ids": ids,
                                 "bases": tags, "meta": payload.meta.decode(), "input": sparse(x),
                                 "frames": [f.hex() for f in frames]}
        if delivered:
            try:
                entry["decoded"] = sparse(unpack(decode_message(frames).tensors[0], state=receiver))
            except CodecError as exc:
                entry["refused"] = {"error": "CodecError", "rule": "delta", "message": str(exc)}
        entry["sender"], entry["receiver"] = end(sender), end(receiver)
        out.append(entry)
    return {"codec": SPEC, "about": "one stream, sender and receiver each with the codec's cache (mb=1: 2^20 "
            "bytes); ids are the rows' example ids; bases are the tags t_i of part 1 (0: a direct row); a cache "
            "is [id, seq of the message that stored it, row shape], least recently used first", "messages": out}


def _rows(state: dict) -> dict[int, torch.Tensor]:
    """The sender's cached rows before a message, by example id."""
    if "cache" not in state:
        return {}
    held = state["cache"].state_dict()
    return dict(zip(held["ids"].tolist(), held["rows"]))


def generate() -> dict[str, dict[str, Any]]:
    return {"streams.json": {"streams": [stream()]}}


def load() -> dict[str, Any]:
    return json.loads((ROOT / "streams.json").read_text())


def main() -> int:
    return write_or_check(generate(), ROOT, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
