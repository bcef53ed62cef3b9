"""Payloads a peer can send that once escaped the decoders' contract (found by fuzzing `decode_message` +
`unpack`): each must be refused with the project's own error, change no receiver state, and cost
memory in proportion to what it honestly decodes to."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from nebula import wire
from nebula._proto import nebula_pb2 as pb
from nebula.codecs import CodecState, pack, unpack
from nebula.errors import CodecError, WireError


def test_a_zero_size_part_with_huge_other_dimensions_is_a_wire_error():
    frames = wire.encode_message(wire.Message(kind=wire.Kind.TENSORS, tensors=[pack("x", "a", torch.zeros(0), "none")]))
    envelope = pb.Envelope()
    envelope.ParseFromString(frames[0])
    del envelope.tensors[0].parts[0].shape[:]
    envelope.tensors[0].parts[0].shape.extend([0, 2 ** 63 - 1, 2 ** 63 - 1])  # 0 bytes: the product passed
    frames[0] = envelope.SerializeToString()
    with pytest.raises(WireError, match="exceeds the message limit"):
        wire.decode_message(frames)


def test_a_negative_header_shape_is_a_codec_error():
    payload = pack("x", "a", torch.randn(1), "none")
    payload.shape = (-1, -1)  # prod() == 1 matched the element count
    with pytest.raises(CodecError, match="non-negative integers"):
        unpack(payload)


def held(slot) -> tuple:
    cache = slot["cache"]
    return cache.state_dict()["ids"].tolist(), cache.state_dict()["seqs"].tolist(), cache.stats()


def test_a_delta_message_refused_for_its_header_shape_is_not_applied():
    sender, receiver, ids = CodecState().slot("l", "h"), CodecState().slot("l", "h"), torch.tensor([1, 2])
    unpack(pack("h", "a", torch.randn(2, 8), "delta(int8)", state=sender, ids=ids), state=receiver)
    before = held(receiver)
    payload = pack("h", "a", torch.randn(2, 8), "delta(int8)", state=sender, ids=ids)
    payload.shape = (3,)
    with pytest.raises(CodecError, match="not the header's shape"):
        unpack(payload, state=receiver)
    assert held(receiver) == before  # message 2's rows were stored before the check


def test_a_delta_message_refused_for_its_parts_leaves_the_lru_order_and_counts_as_they_were():
    spec = "delta(int8, mb=1)"  # holds 4 rows of 65280 floats (255 KiB and ENTRY_BYTES each)
    sender, kept, refusing = (CodecState().slot("l", "h") for _ in range(3))

    def send(x, ids):
        return pack("h", "a", x, spec, state=sender, ids=torch.tensor(ids))
    first = send(torch.randn(4, 65280), [1, 2, 3, 4])
    for receiver in (kept, refusing):
        unpack(first, state=receiver)
    bad = pack("h", "a", torch.randn(1, 65280), spec, state=CodecState().slot("l", "h"), ids=torch.tensor([9]))
    bad.parts[0] = bad.parts[1] = torch.tensor([1])  # a delta of example 1 against message 1: a real base
    bad.parts[3] = torch.ones(5)  # int8's scales: 5 for 65280 values
    bad.meta = b'{"seq":2,"row":[65280],"d":null,"r":[2,{}]}'
    with pytest.raises(CodecError, match="scales"):
        unpack(bad, state=refusing)
    assert held(refusing) == held(kept)  # example 1 was made the most recent, its hit counted
    for message in (send(torch.randn(1, 65280), [5]), send(torch.randn(1, 65280), [2])):
        for receiver in (kept, refusing):  # once evicted the wrong example; then refused this one
            unpack(message, state=receiver)
    assert held(refusing) == held(kept)


def test_a_refused_message_of_another_codec_keeps_the_streams_delta_state():
    sender, receiver, ids = CodecState().slot("l", "h"), CodecState().slot("l", "h"), torch.tensor([1, 2])
    x = torch.randn(2, 8)
    unpack(pack("h", "a", x, "delta(int8)", state=sender, ids=ids), state=receiver)
    junk = pack("h", "a", x, "none")
    junk.parts = []
    with pytest.raises(CodecError, match="expected 1 parts"):
        unpack(junk, state=receiver)  # claimed the slot for `none` and emptied it, before being refused
    payload = pack("h", "a", x, "delta(int8)", state=sender, ids=ids)
    assert payload.parts[1].tolist() == [1, 1]
    unpack(payload, state=receiver)  # a delta against the bases message 1 left
    accepted = pack("h", "a", x, "int8")
    unpack(accepted, state=receiver)
    assert receiver == {"spec": "int8"}  # an accepted message of another codec still resets the stream


def peak_rss_growth_mib(code: str) -> tuple[str, int]:
    """Run `code` (which sets `payload`) in a fresh interpreter; its unpack's outcome and peak RSS growth."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            unpack(wire.decode_message(wire.encode_message(
                wire.Message(kind=wire.Kind.TENSORS, tensors=[payload]))).tensors[0])
            outcome = "decoded"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        print(json.dumps([outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outcome, grown = json.loads(done.stdout.splitlines()[-1])
    return outcome, grown


def test_a_chain_whose_parts_claim_to_expand_is_refused_before_it_allocates():
    outcome, grown = peak_rss_growth_mib("""
        import json, torch
        from nebula import wire
        from nebula.codecs import unpack
        groups, size = 12, 1 << 26  # 12 topk groups of 256 MiB of zeros each, from 0-byte parts
        meta = json.dumps({"i": {"shape": [1]}, "o": [[2, {"shape": [size]}]] * groups}).encode()
        parts = [torch.empty(0), torch.empty(0, dtype=torch.int32)] * groups
        payload = wire.TensorPayload("x", "a", "float32", (1,), "topk(svd(0.5), 0.5)", meta, parts)
    """)
    assert outcome.startswith("CodecError") and "would decode to more than" in outcome
    assert grown < 64  # it allocated 3 GiB before being refused


def test_deflate_of_many_small_integers_costs_about_its_output():
    outcome, grown = peak_rss_growth_mib("""
        import json, zlib, torch
        from nebula import wire
        from nebula.codecs import unpack
        n = 1 << 24  # 16M int64 zeros: 128 MiB out of a 16 KB stream
        stream = zlib.compress(bytes(n), 9)
        meta = json.dumps({"dtype": "int64", "shape": [n]}).encode()
        payload = wire.TensorPayload("ids", "tokens", "int64", (n,), "deflate", meta,
                                     [torch.frombuffer(bytearray(stream), dtype=torch.uint8)])
    """)
    assert outcome == "decoded"
    assert grown < 128 + 16 + 160  # output, inflated bytes, one chunk's temporaries; it was ~940 MiB
