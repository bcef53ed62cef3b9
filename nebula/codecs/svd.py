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

from nebula.codecs.base import (FLOAT_DTYPES, Codec, Meta, Parts, check_part, check_parts, check_ratio, meta_shape,
                                register_codec, require_finite, require_float)
from nebula.errors import CodecError


@register_codec("svd")
@dataclass(frozen=True)
class Svd(Codec):
    ratio: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", float(self.ratio))
        check_ratio("svd", "ratio", self.ratio)

    def encode(self, x: torch.Tensor, state: dict | None = None) -> tuple[Parts, Meta]:
        a = as_matrix("svd", x)  # (m, n)
        k = rank_for(self.ratio, *a.shape)
        if k == 0:  # an empty tensor
            return [a.new_zeros(a.shape[0], 0), a.new_zeros(0, a.shape[1])], {"shape": list(x.shape)}
        u, s, vh = torch.linalg.svd(a, full_matrices=False)  # (m, q), (q,), (q, n), q = min(m, n)
        return [(u[:, :k] * s[:k]).contiguous(), vh[:k].contiguous()], {"shape": list(x.shape)}

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


def decode_factors(codec: str, parts: Parts, meta: Meta) -> torch.Tensor:
    """us (m, k) @ vh (k, n) -> the original shape from meta, float32."""
    check_parts(codec, parts, 2)
    us, vh = parts
    check_part(codec, us, "part 0 (U S)", FLOAT_DTYPES, ndim=2)
    check_part(codec, vh, "part 1 (V^T)", FLOAT_DTYPES, ndim=2)
    shape = meta_shape(codec, meta)
    m, k, n = us.shape[0], us.shape[1], vh.shape[1]
    if vh.shape[0] != k or m * n != torch.Size(shape).numel():
        raise CodecError(f"codec {codec!r}: factors {tuple(us.shape)} @ {tuple(vh.shape)} do not make "
                         f"a tensor of shape {list(shape)}")
    return (us.float() @ vh.float()).view(shape)
