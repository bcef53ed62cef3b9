"""Every codec round-trips through pack -> wire frames -> unpack within its error and byte bounds."""
from __future__ import annotations

import math

import pytest
import torch

from nebula.codecs import CODECS, CodecState, pack, parse, unpack
from nebula.wire import Kind, Message, decode_message, encode_message


def low_rank(m: int, n: int, rank: int = 8, noise: float = 0.01, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g)
    return x + noise * x.norm() / math.sqrt(m * n) * torch.randn(m, n, generator=g)


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def optimal_rank_error(x: torch.Tensor, k: int) -> float:
    """Eckart-Young: the best rank-k relative error of x viewed as (prod(leading), H)."""
    s = torch.linalg.svdvals(x.reshape(-1, x.shape[-1]).double())
    return float(s[k:].norm() / s.norm())


# spec -> (tensor, max relative error, max wire/raw ratio); the registry test below requires a case for
# every registered codec name, so a new codec cannot land without one.
CASES = {
    "none": (gaussian(4, 8, 32), 0.0, 1.0),
    "fp16": (gaussian(4, 8, 32), 5e-4, 0.5),
    "bf16": (gaussian(4, 8, 32), 4e-3, 0.5),
    "int8": (gaussian(64, 768), 0.0062, 0.2657),
    "int8(scale=bf16)": (gaussian(64, 768), 0.0062, 0.2579),
    "int8(block=32, scale=bf16)": (gaussian(64, 768), 0.0056, 0.2657),
    "int8(7)": (gaussian(5, 13), 0.006, 0.62),  # a short last block
    "int4": (gaussian(64, 768), 0.11, 0.1329),
    "int4(7, scale=fp32)": (gaussian(5, 13), 0.075, 0.5),  # an odd count, a short last block
    "svd(0.25)": (low_rank(96, 64).view(4, 24, 64), 0.02, 0.43),
    "lowrank(0.25)": (low_rank(96, 64).view(4, 24, 64), 0.02, 0.43),
    "lowrank(0.25, oversample=0, iters=3)": (low_rank(64, 160).view(64, 160), 0.02, 0.5),  # wide: transposed
    "topk(0.25)": (gaussian(16, 64), 0.75, 0.5),
    "ef(topk(0.25))": (gaussian(16, 64), 0.75, 0.5),
    "fp16(svd(0.25))": (low_rank(96, 64).view(4, 24, 64), 0.02, 0.22),
    "int8(lowrank(0.25))": (low_rank(96, 64), 0.025, 0.12),
    "int4(lowrank(0.25))": (low_rank(96, 64), 0.2, 0.06),
    "fp16(topk(0.25))": (gaussian(16, 64), 0.75, 0.38),
    "ef(int8(topk(0.5), block=16))": (gaussian(16, 64), 0.75, 0.69),
    "deflate": (gaussian(4, 8, 32), 0.0, 0.95),  # lossless, any dtype: token ids in test_codecs_deflate.py
}


def through_wire(payload):
    frames = encode_message(Message(Kind.TENSORS, tensors=[payload]))
    return decode_message([bytes(f) for f in frames]).tensors[0]  # bytes: read-only, as a socket gives them


def test_every_registered_codec_has_a_round_trip_case():
    covered = {spec.split("(")[0] for spec in CASES}  # the outermost codec of each case
    covered.add("delta")  # keeps rows at both ends and needs example ids: tests/unit/test_codecs_delta.py
    missing = sorted(set(CODECS) - covered)
    assert not missing, f"add a CASES entry for codec(s) {missing}"


@pytest.mark.parametrize("spec", list(CASES))
def test_round_trip_through_the_wire(spec):
    x, max_error, max_ratio = CASES[spec]
    payload = pack("h", "activation", x, spec, state=CodecState().slot("a->b", "h"))
    y = unpack(through_wire(payload))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert float((y - x).norm() / x.norm()) <= max_error
    assert payload.wire_bytes <= max_ratio * x.numel() * 4
    assert payload.codec == parse(spec).spec


def test_svd_is_optimal_and_lowrank_close_to_it():
    x = low_rank(256, 96, rank=12, noise=0.3)
    k = round(0.25 * 96)
    exact = float((unpack(pack("x", "activation", x, "svd(0.25)")) - x).norm() / x.norm())
    fast = float((unpack(pack("x", "activation", x, "lowrank(0.25)")) - x).norm() / x.norm())
    assert exact == pytest.approx(optimal_rank_error(x, k), rel=1e-3)
    assert exact <= fast <= 1.05 * exact


@pytest.mark.parametrize("magnitude", [1e-25, 1e-15, 1.0, 1e20, 1e36])
def test_svd_and_lowrank_keep_every_magnitude(magnitude):
    """lowrank's A^T (A V) squares |x|: unscaled, 1e-25 underflowed (error 0.88 against svd's 0.003) and
    1e19 overflowed (a false NaN/Inf refusal); svd's singular value of 5e38 at 1e36 was Inf."""
    x = low_rank(256, 128) * magnitude
    errors = {}
    for spec in ("svd(0.1)", "lowrank(0.1)"):
        y = unpack(through_wire(pack("x", "activation", x, spec))).double()
        errors[spec] = float((y - x.double()).norm() / x.double().norm())
    assert errors["svd(0.1)"] == pytest.approx(optimal_rank_error(x.double(), 13), rel=1e-3)
    assert errors["lowrank(0.1)"] <= 1.05 * errors["svd(0.1)"], errors


@pytest.mark.parametrize("spec", ["svd(0.5)", "lowrank(0.5)", "int8(svd(0.5))"])
def test_a_finite_tensor_near_float32s_limit_factors_to_finite_parts(spec):
    x = torch.full((4, 4), 1e38)  # one singular value, 4e38: beyond float32, though U S (2e38) is not
    payload = pack("x", "activation", x, spec)
    assert all(bool(torch.isfinite(part.float()).all()) for part in payload.parts)
    assert float((unpack(payload).double() - x.double()).norm() / x.double().norm()) < 0.01


def test_svd_wire_bytes_follow_eq4():
    x = gaussian(8192 // 64, 64, 96)  # m = 8192, n = 96
    k = round(0.5 * 96)
    payload = pack("x", "activation", x, "svd(0.5)")
    assert payload.wire_bytes == 4 * k * (8192 + 96)
    assert [tuple(p.shape) for p in payload.parts] == [(8192, k), (k, 96)]


def test_fp16_of_svd_halves_the_factors():
    x = low_rank(128, 64)
    assert pack("x", "a", x, "fp16(svd(0.5))").wire_bytes * 2 == pack("x", "a", x, "svd(0.5)").wire_bytes


def test_topk_keeps_the_largest_entries_exactly():
    x = gaussian(1000)
    y = unpack(through_wire(pack("g", "gradient", x, "topk(0.1)")))
    kept = y != 0
    assert int(kept.sum()) == 100
    assert torch.equal(y[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())


@pytest.mark.parametrize("scale", ["bf16", "fp32"])
def test_int8_values_never_wrap(scale):
    x = gaussian(64 * 2000) * torch.rand(2000, generator=torch.Generator().manual_seed(1)).repeat_interleave(64)
    payload = pack("x", "a", x, f"int8(scale={scale})")
    assert -127 <= int(payload.parts[0].min()) and int(payload.parts[0].max()) <= 127
    assert float((unpack(payload) - x).norm() / x.norm()) < 0.0065


@pytest.mark.parametrize("scale", ["bf16", "fp32"])
def test_int8_keeps_every_magnitude_and_zero_blocks(scale):
    segments = [torch.zeros(64), gaussian(6400) * 1e-30, gaussian(6400), gaussian(640) * 1e30]
    y = unpack(pack("x", "a", torch.cat(segments), f"int8(scale={scale})")).double()
    assert torch.equal(y[:64], torch.zeros(64, dtype=torch.double))
    for got, want in zip(y.split([len(s) for s in segments])[1:], segments[1:]):
        assert float((got - want.double()).norm() / want.double().norm()) < 0.008  # 640 samples: noisy


def test_int4_at_twice_the_rank_beats_int8_at_the_same_bytes_on_a_spread_spectrum():
    """The trade int4 exists for: a matrix whose singular values fall slowly (as activations' do), where
    the extra rank removes more error than the coarser values add."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 384, generator=g) @ torch.diag(torch.arange(1, 385, dtype=torch.float32) ** -0.7) \
        @ torch.linalg.qr(torch.randn(384, 384, generator=g)).Q
    errors, sizes = {}, {}
    for spec in ("int8(lowrank(0.125))", "int4(lowrank(0.25))"):  # ranks 8 and 16
        payload = pack("h", "activation", x, spec)
        errors[spec], sizes[spec] = float((unpack(payload) - x).norm() / x.norm()), payload.wire_bytes
    assert sizes["int4(lowrank(0.25))"] <= 1.01 * sizes["int8(lowrank(0.125))"]
    assert errors["int4(lowrank(0.25))"] < 0.95 * errors["int8(lowrank(0.125))"], errors


def test_integer_tensors_pass_through_none_untouched():
    ids = torch.randint(0, 250_000, (8, 128), dtype=torch.int64)
    y = unpack(through_wire(pack("ids", "tokens", ids, "none")))
    assert y.dtype == torch.int64 and torch.equal(y, ids)


def test_lossy_codecs_decode_to_the_sender_dtype():
    x = gaussian(16, 64).to(torch.bfloat16)
    for spec in ("fp16", "int8", "svd(0.5)", "topk(0.5)"):
        assert unpack(through_wire(pack("x", "a", x, spec))).dtype == torch.bfloat16


def test_empty_tensors_round_trip():
    for spec in ("none", "fp16", "int8", "svd(0.5)", "lowrank(0.5)", "topk(0.5)"):
        x = torch.empty(0, 16)
        y = unpack(through_wire(pack("x", "a", x, spec)))
        assert y.shape == (0, 16)


def test_meta_stays_small_for_a_25mb_activation():
    x = gaussian(128, 64, 768)
    for spec in ("int8", "fp16(svd(0.6))", "int8(lowrank(0.2))"):
        payload = pack("h", "activation", x[:, :, :] if spec == "int8" else x[:8], spec)
        header = len(encode_message(Message(Kind.TENSORS, tensors=[payload]))[0])
        assert header <= 0.0001 * x.numel() * 4, (spec, header)
