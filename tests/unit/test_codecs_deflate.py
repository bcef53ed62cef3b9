"""`deflate`: bit-exact for every wire dtype, small for token ids, and nothing from the network gets
past it as anything but a CodecError (corrupt, truncated and zip-bomb streams included)."""
from __future__ import annotations

import dataclasses
import json
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula.codecs import canonical, pack, parse, unpack
from nebula.codecs.deflate import MAX_DECODED_BYTES, Deflate
from nebula.errors import CodecError, ConfigError
from nebula.wire import Kind, Message, decode_message, encode_message
from tests.support.codecs import token_ids


def through_wire(payload):
    frames = encode_message(Message(Kind.TENSORS, tensors=[payload]))
    return decode_message([bytes(f) for f in frames]).tensors[0]  # bytes: read-only, as a socket gives them


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    def raw(t):  # stride 1 even for one element (torch calls it contiguous at any stride)
        return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)
    return x.numel() == 0 or torch.equal(raw(x), raw(y))


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])  # bits, not values
    return x


TENSORS = {
    "int32 ids": token_ids(),
    "int64 ids": token_ids(torch.int64),
    "bool mask": token_ids() != 0,
    "uint8": torch.randint(0, 256, (3, 50), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)),
    "int8": torch.randint(-128, 128, (50,), dtype=torch.int8, generator=torch.Generator().manual_seed(3)),
    "float32": special_floats(torch.float32),
    "float16": special_floats(torch.float16),
    "bfloat16": special_floats(torch.bfloat16),
    "strided": token_ids().t(),
    "scalar": torch.tensor(-7, dtype=torch.int64),
    "empty": torch.empty(0, dtype=torch.int32),
    "empty (0, 128)": torch.empty(0, 128, dtype=torch.int64),
    "empty (4, 0) bool": torch.empty(4, 0, dtype=torch.bool),
    # no elements, with stride 0 (torch.from_numpy of an empty array): viewing them as bytes for the byte
    # shuffle raised RuntimeError
    "empty float32, stride 0": torch.from_numpy(np.zeros(0, np.float32)),
    # one element at stride 2 (a batch of one, sliced): torch calls it contiguous, bytes need stride 1
    "one float32 at stride 2": torch.tensor([[1.5, 2.0]])[:, 0],
    "one int64 at stride 2": torch.tensor([[5, 6]])[:, 0],
}


@pytest.mark.parametrize("spec", ["deflate", "deflate(level=1)", "deflate(level=9)"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_round_trip_is_bit_exact_for_every_wire_dtype(name, spec):
    x = TENSORS[name]
    payload = pack("ids", "tokens", x, spec)
    assert [(p.dtype, p.dim()) for p in payload.parts] == [(torch.uint8, 1)]
    y = unpack(through_wire(payload))
    assert same_bits(x, y)
    y[...] = 0 if y.dtype != torch.bool else False  # a fresh tensor, not a read-only view of the frame


def test_meta_names_the_dtype_and_the_shape():
    assert json.loads(pack("ids", "tokens", token_ids(), "deflate").meta) == {"dtype": "int32", "shape": [16, 128]}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_token_ids_take_well_under_4_bytes_per_element(dtype):
    x = token_ids(dtype)
    per_element = pack("ids", "tokens", x, "deflate").wire_bytes / x.numel()
    assert per_element < 2.5  # against 4 and 8 raw


def test_the_transform_is_what_makes_the_high_bytes_free():
    x = token_ids()
    plain = len(zlib.compress(x.reshape(-1).view(torch.uint8).numpy(), 6))
    assert pack("ids", "tokens", x, "deflate").wire_bytes < 0.85 * plain


@pytest.mark.parametrize("text, spec", [
    ("deflate", "deflate"), ("deflate()", "deflate"), ("deflate(level=6)", "deflate"),
    ("deflate(level=9)", "deflate(level=9)"), ("deflate( 1 )", "deflate(level=1)"),
])
def test_specs_round_trip_to_their_canonical_form(text, spec):
    assert parse(text).spec == canonical(text) == spec
    assert parse(spec).spec == spec and parse(spec) == Deflate(level=parse(spec).level)


@pytest.mark.parametrize("spec, words", [
    ("deflate(level=0)", "1..9"), ("deflate(10)", "1..9"), ("deflate(level=1.5)", "integer"),
    ("deflate(level=fast)", "integer"), ("deflate(size=3)", "unknown parameter 'size'"),
])
def test_bad_levels_are_config_errors(spec, words):
    with pytest.raises(ConfigError) as info:
        parse(spec)
    assert words in str(info.value)


@pytest.mark.parametrize("level", [0, 10, -1, True, 6.0, "6"])
def test_bad_levels_are_refused_at_construction(level):
    with pytest.raises(ConfigError, match="1..9"):
        Deflate(level=level)


def test_dtypes_the_wire_cannot_carry_are_refused():
    with pytest.raises(CodecError, match="allowed"):
        Deflate().encode(torch.zeros(4, dtype=torch.float64))


def test_as_an_outer_codec_it_repacks_the_float_parts_losslessly():
    # what composition means for every outer codec: float parts re-encoded, integer parts passed through
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(4))
    for inner in ["fp16(svd(0.5))", "topk(0.1)", "int8"]:
        alone, wrapped = pack("h", "a", x, inner), pack("h", "a", x, f"deflate({inner})")
        assert torch.equal(unpack(through_wire(wrapped)), unpack(alone))
        assert wrapped.wire_bytes < alone.wire_bytes
    assert pack("h", "a", x, "deflate(int8)").parts[0].dtype == torch.int8  # int8's values stay raw


# ---- hostile input: every bad part or meta is a CodecError from the codec itself (never zlib.error) ----

def _decode(part: torch.Tensor | bytes, meta: dict) -> torch.Tensor:
    if isinstance(part, bytes):
        part = torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)
    return Deflate().decode([part], meta)


IDS_PART = pack("ids", "tokens", token_ids(), "deflate").parts[0]
IDS_META = {"dtype": "int32", "shape": [16, 128]}


@pytest.mark.parametrize("at", [0, 1, 2, 50, len(IDS_PART) // 2, -5, -1])
def test_corrupted_bytes_are_refused(at):
    part = IDS_PART.clone()
    part[at] ^= 0xFF
    with pytest.raises(CodecError, match="deflate"):
        _decode(part, IDS_META)


@pytest.mark.parametrize("keep", [0, 1, 2, 100, len(IDS_PART) // 2, len(IDS_PART) - 4, len(IDS_PART) - 1])
def test_truncated_streams_are_refused(keep):
    with pytest.raises(CodecError, match="deflate"):
        _decode(IDS_PART[:keep], IDS_META)


def test_bytes_after_the_stream_are_refused():
    with pytest.raises(CodecError, match="after the zlib stream"):
        _decode(bytes(IDS_PART.numpy()) + b"\x00\x01", IDS_META)


def test_a_stream_shorter_than_its_shape_is_refused():
    small = zlib.compress(bytes(1000))
    with pytest.raises(CodecError, match="holds 1000 complete varints"):
        _decode(small, {"dtype": "int64", "shape": [1 << 20]})


def test_a_zip_bomb_is_refused_without_inflating_it():
    bomb = zlib.compressobj(9)
    stream = b"".join(bomb.compress(bytes(1 << 20)) for _ in range(64)) + bomb.flush()  # 64 MB of zeros
    assert len(stream) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="more than the 80 bytes"):
            _decode(stream, {"dtype": "int32", "shape": [16]})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # inflated 65 bytes, not 64 MB


@pytest.mark.parametrize("meta, words", [
    ({"shape": [16, 128]}, "meta['dtype']"), ({"dtype": "complex64", "shape": [4]}, "meta['dtype']"),
    ({"dtype": 4, "shape": [4]}, "meta['dtype']"), ({"dtype": "float64", "shape": [4]}, "meta['dtype']"),
    ({"dtype": "int32"}, "meta['shape']"), ({"dtype": "int32", "shape": "16x128"}, "meta['shape']"),
    ({"dtype": "int32", "shape": [16, -128]}, "meta['shape']"),
    ({"dtype": "int32", "shape": [16.0, 128]}, "meta['shape']"),
    ({"dtype": "int32", "shape": [1 << 30]}, "over the limit"),
    ({"dtype": "int64", "shape": [1 << 29]}, f"over the limit of {MAX_DECODED_BYTES}"),
    ({"dtype": "int32", "shape": [16, 127]}, "complete varints"),
    ({"dtype": "int64", "shape": [16, 129]}, "complete varints"), ({"dtype": "float32", "shape": [16, 128]}, "needs"),
])
def test_bad_meta_is_refused(meta, words):
    with pytest.raises(CodecError) as info:
        _decode(IDS_PART, meta)
    assert words in str(info.value)


def test_bool_bytes_other_than_0_and_1_are_refused():
    with pytest.raises(CodecError, match="bool"):
        _decode(zlib.compress(bytes([0, 1, 2, 1])), {"dtype": "bool", "shape": [4]})


@pytest.mark.parametrize("parts, words", [
    ([], "expected 1 parts"), ([IDS_PART, IDS_PART], "expected 1 parts"),
    ([IDS_PART.to(torch.int32)], "dtype"), ([IDS_PART[:100].view(10, 10)], "dimensions"),
])
def test_bad_parts_are_refused(parts, words):
    with pytest.raises(CodecError) as info:
        Deflate().decode(parts, IDS_META)
    assert words in str(info.value)


def test_unpack_refuses_a_header_that_disagrees_with_the_meta():
    payload = dataclasses.replace(pack("ids", "tokens", token_ids(), "deflate"), shape=(8, 128))
    with pytest.raises(CodecError, match="decoded 2048 elements"):
        unpack(payload)


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=64), st.builds(lambda b, n: zlib.compress(bytes(b) * n),
                                                         st.binary(max_size=8), st.integers(0, 64))),
       cut=st.integers(0, 80), dtype=st.sampled_from(["int32", "int64", "bool", "uint8", "float16", "x"]),
       shape=st.lists(st.integers(-1, 40), max_size=3))
def test_any_part_and_meta_gives_a_tensor_or_a_codec_error(data, cut, dtype, shape):
    try:
        y = _decode(data[:cut], {"dtype": dtype, "shape": shape})
    except CodecError:
        return
    assert list(y.shape) == shape and y.dtype == getattr(torch, dtype)
