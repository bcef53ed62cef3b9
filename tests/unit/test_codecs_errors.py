"""Bad specs raise ConfigError, bad data CodecError, and nothing from the network raises anything else."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula.codecs import Codec, pack, parse, register_codec, unpack
from nebula.errors import CodecError, ConfigError
from nebula.wire import TensorPayload

LOSSY = ["fp16", "bf16", "int8", "int4", "svd(0.5)", "lowrank(0.5)", "topk(0.1)", "fp16(svd(0.5))"]


@pytest.mark.parametrize("spec, words", [
    ("zstd", "unknown codec"), ("fp16(svd(", "expected"), ("svd", "missing parameter 'ratio'"),
    ("svd(0)", "(0, 1]"), ("svd(1.5)", "(0, 1]"), ("lowrank(-0.2)", "(0, 1]"), ("topk(2)", "(0, 1]"),
    ("int8(block=0)", "block"), ("int8(block=1.5)", "integer"), ("int8(scale=fp16)", "must be one of bf16, fp32"),
    ("int4(block=0)", "block"), ("int4(scale=fp16)", "must be one of bf16, fp32"),
    ("int8(size=3)", "unknown parameter 'size'"), ("svd(0.5, 0.6)", "at most 1 positional"),
    ("svd(0.5, ratio=0.6)", "both by position and by name"), ("fp16(svd(0.5), svd(0.5))", "inner codec"),
    ("ef", "needs an inner codec"), ("fp16)", "unexpected"), ("fp16 fp16", "unexpected"), ("", "codec name"),
    ("int8(block=3, block=4)", "given twice"), ("fp16(#)", "unexpected character '#'"), ("a" * 300, "limit"),
    ("f(" * 20 + ")" * 20, "nested"),
    # only ASCII whitespace separates tokens (str.strip() took Unicode's, and counted '\x1c' as one column)
    ("int8\x1c", "unexpected character '\\x1c' at column 5 (only space, tab"),
    ("int8(block=64)\u3000", "unexpected character '\\u3000' at column 15"),
    ("int8\xa0", "'\\xa0' at column 5"), ("int8\x85", "'\\x85' at column 5"),
    ("\x1cint8", "unexpected character '\\x1c' at column 1"), ("int8(\u2003)", "'\\u2003' at column 6"),
    # the inner codec before any other argument
    ("int8(block=32, lowrank(0.5))", "the inner codec must be the first argument"),
    ("delta(mb=8, int8)", "move 'int8' before the others; found it at column 13"),
    ("int8(64, lowrank(0.5))", "move 'lowrank' before the others; found it at column 10"),
    ("delta(int8, 8, fp16)", "'delta' takes one inner codec, found a second one, 'fp16', at column 16"),
])
def test_bad_specs_raise_config_errors_that_say_what(spec, words):
    with pytest.raises(ConfigError, match=None) as info:
        parse(spec)
    assert words in str(info.value)


@pytest.mark.parametrize("spec", LOSSY)
def test_integer_tensors_are_refused_by_float_codecs(spec):
    with pytest.raises(CodecError, match="int64"):
        pack("ids", "tokens", torch.arange(64).view(8, 8), spec)


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_are_refused(spec, bad):
    x = torch.randn(8, 16)
    x[3, 5] = bad
    with pytest.raises(CodecError, match="NaN/Inf"):
        pack("h", "activation", x, spec)


@pytest.mark.parametrize("spec", ["svd(1.0)", "lowrank(1.0)", "fp16(svd(1.0))"])
def test_a_factor_beyond_float32_is_refused_not_sent_as_inf(spec):
    """A (16, 16) of 1e38 is finite, but its U S = A V is 4e38: svd sent Inf, lowrank blamed NaN/Inf input."""
    with pytest.raises(CodecError, match=r"U S of this tensor has entries beyond float32's range .* 'bf16'"):
        pack("h", "activation", torch.full((16, 16), 1e38), spec)


def test_fp16_overflow_is_refused_with_a_fix():
    with pytest.raises(CodecError, match="bf16"):
        pack("h", "activation", torch.full((4,), 1e6), "fp16")


def test_bf16_refuses_only_values_that_round_to_inf():
    """The check sums the copy in float32, which overflows for large finite values: those travel."""
    big = torch.full((1000,), 1e36)
    assert torch.equal(unpack(pack("h", "activation", big, "bf16")), big.bfloat16().float())
    with pytest.raises(CodecError, match="round to Inf"):
        pack("h", "activation", torch.tensor([1.0, 3.399e38]), "bf16")


def test_ef_without_state_is_refused():
    with pytest.raises(CodecError, match="state"):
        pack("g", "gradient", torch.randn(16), "ef(topk(0.5))")


def test_duplicate_codec_names_are_refused():
    with pytest.raises(ConfigError, match="already registered"):
        @register_codec("int8")
        @dataclasses.dataclass(frozen=True)
        class Other(Codec):
            def encode(self, x, state=None, *, ids=None):
                return [x], {}

            def decode(self, parts, meta):
                return parts[0]


def _payload(spec: str, x: torch.Tensor | None = None, **changes) -> TensorPayload:
    payload = pack("h", "activation", torch.randn(8, 16) if x is None else x, spec)
    return dataclasses.replace(payload, **changes)


@pytest.mark.parametrize("spec, changes, words", [
    ("svd(0.5)", {"meta": b"{not json"}, "not valid JSON"),
    ("svd(0.5)", {"meta": b"[1, 2]"}, "JSON object"),
    ("svd(0.5)", {"meta": b'{"shape": "8x16"}'}, "shape"),
    ("svd(0.5)", {"meta": b'{"shape": [4, 4]}'}, "do not make"),
    ("topk(0.5)", {"meta": b'{"shape": [1000000, 1000000]}'}, "over the limit"),
    ("topk(0.5)", {"meta": b'{"shape": [2, 2]}'}, "indices outside"),
    ("fp16(svd(0.5))", {"meta": b'{"i": {}, "o": 3}'}, "'o'"),
    ("fp16(svd(0.5))", {"meta": b'{"i": {"shape": [8, 16]}, "o": [[5, {}]]}'}, "parts"),
    ("int8", {"parts": []}, "expected 2 parts"),
    ("fp16", {"codec": "fp16(svd("}, "expected"),
    ("fp16", {"codec": "int8"}, "expected 2 parts"),
    ("none", {"shape": (3, 3)}, "shape"),
    ("int8", {"dtype": "complex64"}, "unknown dtype"),
    ("int4", {"meta": b'{"shape": [4, 4]}'}, "bytes of nibbles"),
    ("int4", {"meta": b'{"shape": [-1]}'}, "shape"),
    ("int4", {"meta": b''}, "shape"),
    ("fp16", {"meta": b'[' * 3000 + b']' * 3000}, "JSON"),
])
def test_malformed_payloads_raise_codec_errors(spec, changes, words):
    with pytest.raises(CodecError) as info:
        unpack(_payload(spec, **changes))
    assert words in str(info.value)


def test_int8_scales_that_do_not_match_the_values_are_refused():
    payload = _payload("int8", torch.randn(640))
    bad = dataclasses.replace(payload, parts=[payload.parts[0], payload.parts[1][:3]])
    with pytest.raises(CodecError, match="scales"):
        unpack(bad)


@settings(max_examples=150, deadline=None)
@given(spec=st.sampled_from(["int8", "int4", "fp16(svd(0.5))", "topk(0.5)", "svd(0.5)", "lowrank(0.5)", "none"]),
       meta=st.one_of(st.binary(max_size=64), st.recursive(
           st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=4),
           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["shape", "i", "o", "x"]), c,
                                                              max_size=3), max_leaves=10).map(
           lambda v: __import__("json").dumps(v).encode())),
       drop=st.integers(0, 2))
def test_any_meta_from_the_network_gives_a_tensor_or_a_codec_error(spec, meta, drop):
    payload = _payload(spec, meta=meta)
    payload = dataclasses.replace(payload, parts=payload.parts[:len(payload.parts) - drop])
    try:
        y = unpack(payload)
    except CodecError:
        return
    assert y.shape == payload.shape


def test_topk_duplicate_indices_are_refused():
    """Two values for one index would decode to whichever the scatter wrote last: undefined, so refused."""
    values, indices = torch.tensor([1.0, 2.0]), torch.tensor([3, 3], dtype=torch.int32)
    payload = dataclasses.replace(_payload("topk(0.5)", torch.randn(4)), parts=[values, indices])
    with pytest.raises(CodecError, match="index 3 twice"):
        unpack(payload)


def test_topk_sends_its_indices_in_ascending_order():
    """One selection, one encoding: the bytes a sender produces do not depend on topk's internal order."""
    _, indices = _payload("topk(0.3)", torch.randn(1000)).parts
    assert torch.equal(indices, indices.sort().values)
