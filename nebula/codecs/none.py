"""`none`: the tensor as it is, one part, bit-exact (any wire dtype, integer token ids included)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import Codec, Meta, Parts, check_parts, register_codec
from nebula.errors import CodecError
from nebula.wire import ITEMSIZE, dtype_names


@register_codec("none")
@dataclass(frozen=True)
class NoCodec(Codec):
    """Wire bytes = numel x itemsize. Decoding returns the received (read-only, zero-copy) view."""

    exact = True

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        if x.dtype not in dtype_names():
            raise CodecError(f"codec 'none': dtype {x.dtype} cannot go on the wire "
                             f"(allowed: {', '.join(ITEMSIZE)})")
        return [x.detach().cpu().contiguous()], {}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("none", parts, 1)
        return parts[0]
