"""`svd(r)`: exact truncated SVD (paper §2.3, Eq. 1-4).

A tensor of shape (..., H) is viewed as a matrix A (m = prod(leading), n = H); the codec keeps
k = max(1, round(r * min(m, n))) singular triplets and sends two float32 parts:
part 0 = U_k diag(S_k), (m, k); part 1 = V_k^T, (k, n). Meta: {"shape": original shape}.
Bytes = 4 k (m + n), ratio k (m + n) / (m n): the paper's Eq. 4 without its r term (S is folded
into U). For an activation (8192, 768) at r = 0.2: k = 154, ratio 0.219.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nebula.codecs.base import (
    FLOAT_DTYPES,
    Codec,
    Meta,
    Parts,
    check_part,
    check_parts,
    check_ratio,
    meta_shape,
    register_codec,
    require_finite,
    require_float,
)
from nebula.errors import CodecError


@register_codec("svd")
@dataclass(frozen=True)
class Svd(Codec):
    ratio: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", float(self.ratio))
        check_ratio("svd", "ratio", self.ratio)

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        a = as_matrix("svd", x)  # (m, n)
        k = rank_for(self.ratio, *a.shape)
        if k == 0:  # an empty tensor
            return [a.new_zeros(a.shape[0], 0), a.new_zeros(0, a.shape[1])], {"shape": list(x.shape)}
        e = scale_exponent(a)  # a (4, 4) of 1e38 has a singular value of 4e38, Inf in float32, and U S of 2e38
        u, s, vh = torch.linalg.svd(a * 2.0 ** -e if e else a, full_matrices=False)  # (m, q), (q,), (q, n)
        us = (u[:, :k] * s[:k] * 2.0 ** e).contiguous()  # exact: a power of two, left to right
        require_finite_factor("svd", us)
        return [us, vh[:k].contiguous()], {"shape": list(x.shape)}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        return decode_factors("svd", parts, meta)


def as_matrix(codec: str, x: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (prod(leading), H) float32, checked for dtype and finiteness."""
    require_float(codec, x)
    n = x.shape[-1] if x.dim() else 1
    a = x.detach().cpu().float().reshape(math.prod(x.shape[:-1]), n)  # a view for contiguous float32
    require_finite(codec, a)
    return a


def rank_for(ratio: float, m: int, n: int) -> int:
    return min(max(1, round(ratio * min(m, n))), m, n)


def scale_exponent(a: torch.Tensor) -> int:
    """e such that a * 2^-e is safe to factor in float32; 0 (nothing scaled, so those tensors encode
    bit for bit as they always did) when max |a| is within 2^+-40. lowrank's A^T (A V) squares a's
    magnitude: it overflows from |x| ~ 1e19 (Inf from a finite tensor) and underflows below ~1e-20
    (most of the accuracy lost by 1e-25); svd's singular values reach sqrt(m n) max |a|. Outside
    2^+-40, e is the exponent of max |a| (bringing it to [0.5, 1)), within +-125 so that 2^e is a
    float32. Scaling by a power of two is exact, and the singular vectors do not depend on it."""
    if a.numel() == 0:
        return 0
    lo, hi = torch.aminmax(a)  # no copy of |a|
    top = max(-float(lo), float(hi))
    if top == 0 or 2.0 ** -40 <= top <= 2.0 ** 40:
        return 0
    return max(-125, min(125, math.frexp(top)[1]))


def require_finite_factor(codec: str, us: torch.Tensor) -> None:
    """U_k S_k (m, k) of a finite tensor can still pass float32's range (a (16, 16) of 1e38 has 4e38),
    and the receiver would decode Inf."""
    if not bool(torch.isfinite(us).all()):
        raise CodecError(f"codec {codec!r}: the factor U S of this tensor has entries beyond float32's range "
                         "(3.4e38), which would decode to Inf; scale the tensor down, or send it with codec "
                         "'bf16' or 'none'")


def decode_factors(codec: str, parts: Parts, meta: Meta) -> torch.Tensor:
    """us (m, k) @ vh (k, n) -> the original shape from meta, float32, summed in the order
    docs/protocol.md §3.3 fixes (`ordered_product`)."""
    check_parts(codec, parts, 2)
    us, vh = parts
    check_part(codec, us, "part 0 (U S)", FLOAT_DTYPES, ndim=2)
    check_part(codec, vh, "part 1 (V^T)", FLOAT_DTYPES, ndim=2)
    shape = meta_shape(codec, meta)
    m, k, n = us.shape[0], us.shape[1], vh.shape[1]
    if vh.shape[0] != k or m * n != torch.Size(shape).numel():
        raise CodecError(f"codec {codec!r}: factors {tuple(us.shape)} @ {tuple(vh.shape)} do not make "
                         f"a tensor of shape {list(shape)}")
    return ordered_product(us.float(), vh.float()).view(shape)


# elements of the output computed per pass over k: the block and its temporary stay in the CPU's
# caches (2 x 4 MiB), and a (8192, 768) output takes 6 blocks, few enough Python calls
BLOCK_ELEMENTS = 1 << 20


def ordered_product(us: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """(m, k) @ (k, n) in float32, each output the sum of its k products in k order, starting from
    the first product (not from +0, so a single product keeps its -0.0), each product and each sum
    rounded to float32, no fused multiply-add (docs/protocol.md §3.3). A BLAS matmul sums in an
    order of its own, which differs between libraries, CPUs and thread counts: sender and receiver
    would disagree in the last bits, and delta's caches at the two ends with them. Elementwise torch
    kernels round every result to float32, so one mul and one add per product give exactly this
    order (`addcmul` may fuse them); 5 to 7 times a matmul's time, e.g. 65-70 against 10-14 ms for
    the (8192, 154) @ (154, 768) of lowrank(0.2) on a 25 MB activation (2-core VM)."""
    m, k = us.shape
    n = vh.shape[1]
    out = us.new_empty(m, n)
    if k == 0 or m == 0 or n == 0:
        return out.zero_()  # an empty sum is +0
    rows = max(1, BLOCK_ELEMENTS // n)
    product = us.new_empty(min(rows, m), n)
    for start in range(0, m, rows):
        block, u = out[start:start + rows], us[start:start + rows]  # (r, n), (r, k)
        term = product[:block.shape[0]]
        torch.mul(u[:, :1], vh[:1], out=block)
        for t in range(1, k):
            torch.mul(u[:, t:t + 1], vh[t:t + 1], out=term)
            block.add_(term)
    return out
