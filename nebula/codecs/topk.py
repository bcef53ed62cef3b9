"""`topk(f)`: keep the fraction f of entries with the largest magnitude (sparsification).

Wire: part 0 = values, float32 (k,); part 1 = flat indices, int32 (k,), ascending, each at most once;
k = max(1, round(f * numel)). Meta: {"shape": original shape}. Bytes = 8 k, ratio 2 f. What it drops is
best fed back into the next step: `ef(topk(0.01))` (error feedback, Stich et al. 2018; Lin et al. 2018,
Deep Gradient Compression).
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

MAX_INDEX = (1 << 31) - 1  # indices travel as int32


@register_codec("topk")
@dataclass(frozen=True)
class TopK(Codec):
    fraction: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", float(self.fraction))
        check_ratio("topk", "fraction", self.fraction)

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        require_float("topk", x)
        flat = x.detach().cpu().reshape(-1).float()  # (numel,)
        require_finite("topk", flat)
        if flat.numel() > MAX_INDEX:
            raise CodecError(f"codec 'topk': {flat.numel()} elements exceed int32 indices; split the tensor")
        k = min(flat.numel(), max(1, round(self.fraction * flat.numel())))
        # ascending: one selection has one encoding, whatever order topk found it in
        indices = flat.abs().topk(k, sorted=False).indices.sort().values  # (k,) int64
        return [flat[indices], indices.to(torch.int32)], {"shape": list(x.shape)}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("topk", parts, 2)
        values, indices = parts
        check_part("topk", values, "part 0 (values)", FLOAT_DTYPES, ndim=1)
        check_part("topk", indices, "part 1 (indices)", (torch.int32,), ndim=1)
        shape = meta_shape("topk", meta)
        numel = math.prod(shape)
        if values.numel() != indices.numel():
            raise CodecError(f"codec 'topk': {values.numel()} values but {indices.numel()} indices")
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < numel):
            raise CodecError(f"codec 'topk': indices outside 0..{numel - 1} for shape {list(shape)}")
        ordered = indices.sort().values  # senders send them ascending; older ones did not: any order is fine
        if (repeated := (ordered[1:] == ordered[:-1]).nonzero()).numel():
            raise CodecError(f"codec 'topk': index {int(ordered[repeated[0, 0]])} twice (which value would win "
                             "is undefined); send each index at most once")
        out = torch.zeros(numel, dtype=torch.float32)
        out[indices.long()] = values.float()
        return out.view(shape)
