"""`fp16`: IEEE half precision, one part of the input's shape; 2 bytes per element (ratio 0.5)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import (
    FLOAT_DTYPES,
    Codec,
    Meta,
    Parts,
    check_part,
    check_parts,
    register_codec,
    require_finite,
    require_float,
)
from nebula.errors import CodecError

FP16_MAX = 65504.0


@register_codec("fp16")
@dataclass(frozen=True)
class Fp16(Codec):
    """Values that round beyond +-65504 (|x| >= 65520) would become Inf: refused (use bf16, whose range
    is float32's)."""

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        require_float("fp16", x)
        half = x.detach().cpu().contiguous().to(torch.float16)
        # half.sum is finite iff x was finite and in range: one pass over the 2-byte copy
        if not torch.isfinite(half.sum(dtype=torch.float32)):
            require_finite("fp16", x)
            raise CodecError(f"codec 'fp16': values beyond +-{FP16_MAX:g} (max |x| = {x.abs().max().item():g}) "
                             "overflow half precision; use bf16, or scale the tensor")
        return [half], {}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("fp16", parts, 1)
        check_part("fp16", parts[0], "part 0", FLOAT_DTYPES)  # float32 when nested in int8(...)
        return parts[0].float()
