"""The wire conformance vectors (tests/vectors/wire/): the code decodes each exactly, re-encodes the decoded
message to the same bytes, refuses each reject with the error it names, and reproduces every vector from
its input as far as its `encoder` says (regenerate: python -m tests.vectors.make_wire --regenerate)."""
from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
import torch

from nebula.codecs import unpack
from nebula.wire import decode_message, dtype_names, with_base
from tests.vectors.make_wire import EXACT, FACTORS, ROOT, ZLIB, frames_of, generate, refusal, tensor_bytes, values

STORED = {path.name: json.loads(path.read_text()) for path in sorted(ROOT.glob("*.json"))}
VECTORS = [vector for content in STORED.values() for vector in content.get("vectors", [])]
REJECTS = STORED["rejects.json"]["rejects"]


def frames(entry: dict) -> list[bytes]:
    return [bytes.fromhex(frame) for frame in entry["frames"]]


def test_every_codec_and_kind_has_vectors_and_the_files_stay_small():
    codecs = {tensor["codec"].split("(")[0] for vector in VECTORS for tensor in vector["tensors"]}
    assert codecs >= {"none", "fp16", "bf16", "int8", "svd", "lowrank", "topk", "deflate", "ef"}
    assert {vector["envelope"]["kind"] for vector in VECTORS} == {"TENSORS", "CONTROL", "ACK", "HEARTBEAT", "ERROR"}
    assert max((ROOT / name).stat().st_size for name in STORED) < 16_000


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_the_code_decodes_each_vector_exactly(vector):
    msg = decode_message(frames(vector))
    assert [t.name for t in msg.tensors] == [t["name"] for t in vector["tensors"]]
    for tensor, expected in zip(msg.tensors, vector["tensors"]):
        y = unpack(tensor)
        decoded = expected["decoded"]
        assert (dtype_names()[y.dtype], list(y.shape)) == (decoded["dtype"], decoded["shape"])
        assert tensor_bytes(y).hex() == decoded["hex"]  # bit for bit, signed zeros included
        assert values(y) == decoded["values"]


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_a_decoded_vector_re_encodes_to_the_same_bytes(vector):
    sent = frames(vector)
    msg = decode_message(sent)
    again = frames_of(msg)
    if msg.base and again != sent:  # the base was appended to the envelope, as the reliable channel does
        again = frames_of(dataclasses.replace(msg, base=0))
        again[0] = with_base(again[0], msg.base)
    assert again == sent


@pytest.mark.parametrize("reject", REJECTS, ids=lambda r: r["name"])
def test_each_reject_is_refused_with_the_error_and_rule_it_names(reject):
    error, rule, message = refusal(frames(reject))
    assert (error, message) == (reject["error"], reject["message"])
    # the code names the rule of every WireError (§1.5); a CodecError's is the vector's own claim, which
    # test_protocol_wire checks against §3.2's table
    assert rule == reject["rule"] if error == "WireError" else rule == ""


def _inflated_or_raw(frames: list[bytes], env: dict, encoder: str) -> list[bytes]:
    parts = [part for tensor in env.get("tensors", []) for part in tensor["parts"]]
    return [zlib.decompress(frame) if encoder == ZLIB and part["dtype"] == "uint8" else frame
            for frame, part in zip(frames[1:], parts)]


def _without_checksums(env: dict) -> dict:
    return {**env, "tensors": [{**t, "parts": [{k: v for k, v in p.items() if k not in ("checksum", "nbytes")}
                                               for p in t["parts"]]} for t in env.get("tensors", [])]}


def test_the_vectors_are_what_the_code_generates():
    """Bit for bit where the encoding is exact; the same bytes before zlib (another zlib may compress
    differently); factors that decode to the same values within the vector's tolerance (another LAPACK
    may choose other signs and last bits)."""
    generated = generate()
    assert sorted(generated) == sorted(STORED)
    for name, content in generated.items():
        for now, stored in zip(content.get("vectors", []), STORED[name].get("vectors", []), strict=True):
            encoders = {tensor["encoder"] for tensor in stored["tensors"]} - {EXACT, "decode-only"}
            if not encoders:
                assert now == stored
                continue
            encoder = encoders.pop()
            assert _without_checksums(now["envelope"]) == _without_checksums(stored["envelope"])
            for t_now, t_stored in zip(now["tensors"], stored["tensors"], strict=True):
                assert {k: v for k, v in t_now.items() if k != "decoded"} == \
                       {k: v for k, v in t_stored.items() if k != "decoded"}
                expected = torch.tensor(t_stored["decoded"]["values"])
                got = torch.tensor(t_now["decoded"]["values"])
                if encoder == FACTORS:
                    assert torch.allclose(got, expected, rtol=0, atol=t_stored["tol"] * float(expected.abs().max()))
                else:
                    assert torch.equal(got, expected)
            if encoder == ZLIB:
                assert _inflated_or_raw(frames(now), now["envelope"], ZLIB) == \
                       _inflated_or_raw(frames(stored), stored["envelope"], ZLIB)
    assert generated["rejects.json"] == STORED["rejects.json"]
