"""`bf16`: bfloat16 (float32's range, 8 bits of precision), one part; 2 bytes per element (ratio 0.5)."""
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


@register_codec("bf16")
@dataclass(frozen=True)
class Bf16(Codec):
    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        require_float("bf16", x)
        half = x.detach().cpu().contiguous().to(torch.bfloat16)
        # one reduction in the common case; the sum of large finite values may itself overflow
        if not torch.isfinite(half.sum(dtype=torch.float32)) and not torch.isfinite(half).all():
            require_finite("bf16", x)
            raise CodecError("codec 'bf16': values within 0.4% of the float32 maximum round to Inf in bfloat16; "
                             "scale the tensor")
        return [half], {}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("bf16", parts, 1)
        check_part("bf16", parts[0], "part 0", FLOAT_DTYPES)  # float32 when nested in int8(...)
        return parts[0].float()
