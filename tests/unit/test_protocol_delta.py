"""docs/protocol.md §3.7 against the code through the `delta` stream vectors (tests/vectors/delta/): the
code makes exactly the stored stream; a receiver that is handed only the stored frames decodes, refuses
and caches what the vectors say; and the stream holds every event the section describes (regenerate:
python -m tests.vectors.make_delta --regenerate)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from nebula.codecs import unpack
from nebula.errors import CodecError
from nebula.wire import decode_message
from tests.vectors.make_delta import cache_listing, generate, load, sparse, tensor_bytes

STREAMS = load()["streams"]
MESSAGES = [m for stream in STREAMS for m in stream["messages"]]


def test_the_vectors_are_what_the_code_generates():
    assert generate()["streams.json"] == load(), "regenerate: python -m tests.vectors.make_delta --regenerate"


@pytest.mark.parametrize("stream", STREAMS, ids=lambda s: s["codec"])
def test_a_receiver_handed_the_frames_alone_decodes_refuses_and_caches_as_the_vectors_say(stream):
    receiver: dict = {}
    for m in stream["messages"]:
        if not m["delivered"]:
            continue
        tensor = decode_message([bytes.fromhex(frame) for frame in m["frames"]]).tensors[0]
        assert tensor.codec == stream["codec"]
        if "refused" in m:
            with pytest.raises(CodecError) as refused:
                unpack(tensor, state=receiver)
            assert str(refused.value) == m["refused"]["message"]
        else:
            assert sparse(unpack(tensor, state=receiver)) == m["decoded"]
        assert cache_listing(receiver) == m["receiver"]["cache"], f"message {m['message']}"


@pytest.mark.parametrize("m", MESSAGES, ids=lambda m: f"message-{m['message']}")
def test_a_sparse_listing_and_its_hash_describe_the_same_tensor(m):
    """README: the elements not listed are +0.0, and the SHA-256 covers every byte."""
    for described in (m["input"], m.get("decoded")):
        if described is None:
            continue
        x = torch.zeros(described["shape"])
        for index, value in described["nonzero"]:
            x.view(-1)[index] = value
        assert hashlib.sha256(tensor_bytes(x)).hexdigest() == described["sha256"]


def test_the_stream_holds_every_event_of_section_3_7():
    ends = [(m["sender"], m["receiver"]) for m in MESSAGES]
    assert any(0 in m["bases"] for m in MESSAGES) and any(t for m in MESSAGES for t in m["bases"])  # misses, hits
    evictions = [receiver["evictions"] for _, receiver in ends]
    assert max(b - a for a, b in zip([0, *evictions], evictions)) >= 2  # one store evicting two
    rows = [m["input"]["shape"][1] for m in MESSAGES]
    assert max(rows) > rows[0] > min(rows)  # a base extended and one cut
    lost = [m for m in MESSAGES if not m["delivered"]]
    refused = [m for m in MESSAGES if "refused" in m]
    assert len(lost) == 1 and len(refused) == 1 and refused[0]["message"] > lost[0]["message"]
    assert refused[0]["refused"]["rule"] == "delta"
    before = MESSAGES[refused[0]["message"] - 2]["receiver"]
    assert refused[0]["receiver"] == before  # a refused message changes nothing, its counts included
    assert refused[0]["sender"]["cache"] != refused[0]["receiver"]["cache"]


def test_a_stored_entry_becomes_the_most_recently_used():
    """§3.7 step 4: the delta rows are touched first, then every row stored in order, each going last;
    in message 4, 101 (a delta) is touched before 102 (a miss) is stored, and stored after it."""
    m = MESSAGES[3]
    assert m["ids"] == [102, 101] and m["bases"][0] == 0 and m["bases"][1] != 0
    assert [key for key, _, _ in m["receiver"]["cache"]][-2:] == [102, 101]
