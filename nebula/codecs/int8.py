"""`int8(block=64, scale=fp32)`: blockwise absmax quantisation to int8.

The flattened tensor is cut into blocks of `block` consecutive elements (the last one may be short);
each block b gets scale_b = absmax_b / 127 in the scale dtype (round to nearest) and
q = clamp(rint(x * fl32(1 / scale_b)), -127, 127), ties to even, with the reciprocal taken as 0 where it
overflows (an all-zero block): not round(x / scale_b), which differs at ties (docs/protocol.md §3.3).
The clamp matters when a 2-byte scale rounded down, and it keeps any value from wrapping around.
Wire: part 0 = q, int8, the input's shape; part 1 = scales, (ceil(numel / block),) in `scale` dtype.
Bytes = numel + ceil(numel / block) * sizeof(scale): 0.2656 of float32 at block 64 with fp32 scales,
0.2578 with bf16 scales. fp32 is the default: measured on a Gaussian 25 MB activation it is both more
accurate (0.00593 vs 0.00596) and faster (no clamp pass, no conversions) than bf16; fp16 scales are
not offered, they flush blocks with absmax below ~8e-6 (common in gradients) to zero.

Speed: quantising in eager torch is bound by memory passes and by page faults on fresh 25 MB
temporaries, so the encoder walks the tensor in chunks of ~1M elements that stay in cache
(abs -> amax -> scale -> multiply -> round -> int8), allocating only the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import (Codec, Meta, Parts, check_part, check_parts, register_codec, require_float)
from nebula.errors import CodecError, ConfigError

SCALE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32 scratch: fits in L2+L3 alongside its inputs


@register_codec("int8")
@dataclass(frozen=True)
class Int8(Codec):
    block: int = 64
    scale: str = "fp32"

    def __post_init__(self) -> None:
        if type(self.block) is not int or not 1 <= self.block <= 1 << 20:
            raise ConfigError(f"codec 'int8': block={self.block!r} must be an integer in 1..1048576, e.g. 64")
        if self.scale not in SCALE_DTYPES:
            raise ConfigError(f"codec 'int8': scale={self.scale!r} must be one of {', '.join(SCALE_DTYPES)}")

    def encode(self, x: torch.Tensor, state: dict | None = None) -> tuple[Parts, Meta]:
        require_float("int8", x)
        flat = x.detach().cpu().reshape(-1).float()  # no copy for a contiguous float32 tensor
        nblocks = -(-flat.numel() // self.block)
        q = torch.empty(flat.numel(), dtype=torch.int8)
        scales = torch.empty(nblocks, dtype=SCALE_DTYPES[self.scale])
        nfull = flat.numel() // self.block
        _quantize(flat[:nfull * self.block].view(nfull, self.block), q[:nfull * self.block].view(nfull, self.block),
                  scales[:nfull])
        if nfull < nblocks:  # the short last block
            _quantize(flat[nfull * self.block:].view(1, -1), q[nfull * self.block:].view(1, -1), scales[nfull:])
        if not torch.isfinite(scales).all():
            raise CodecError("codec 'int8': tensor has NaN/Inf values (or |x| beyond the range of "
                             f"{self.scale} scales); fix the producer or send it with codec 'none'")
        return [q.view(x.shape), scales], {}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("int8", parts, 2)
        q, scales = parts
        check_part("int8", q, "part 0 (values)", (torch.int8,))
        check_part("int8", scales, "part 1 (scales)", tuple(SCALE_DTYPES.values()), ndim=1)
        numel, nfull = q.numel(), q.numel() // self.block
        if scales.numel() != -(-numel // self.block):
            raise CodecError(f"codec 'int8': {scales.numel()} scales for {numel} values in blocks of {self.block}, "
                             f"expected {-(-numel // self.block)}")
        out = torch.empty(q.shape, dtype=torch.float32)
        flat_q, flat_out, s32 = q.reshape(-1), out.view(-1), scales.float()
        _dequantize(flat_q[:nfull * self.block].view(nfull, self.block),
                    flat_out[:nfull * self.block].view(nfull, self.block), s32[:nfull])
        _dequantize(flat_q[nfull * self.block:].view(1, -1), flat_out[nfull * self.block:].view(1, -1), s32[nfull:])
        return out


def _quantize(blocks: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """blocks (n, block) float32 -> q (n, block) int8 and scales (n,), chunk by chunk."""
    if blocks.numel() == 0:
        return
    rows = max(1, CHUNK_ELEMENTS // blocks.shape[1])
    scratch = torch.empty(min(rows, blocks.shape[0]), blocks.shape[1])
    for start in range(0, blocks.shape[0], rows):
        chunk = blocks[start:start + rows]  # (r, block)
        tmp = scratch[:chunk.shape[0]]
        torch.abs(chunk, out=tmp)
        scale = tmp.amax(1).div_(127).to(scales.dtype)  # (r,)
        scales[start:start + rows] = scale
        inverse = torch.nan_to_num_(scale.float().reciprocal_(), posinf=0.0)  # all-zero block: scale 0
        torch.mul(chunk, inverse[:, None], out=tmp).round_()
        if scales.dtype != torch.float32:  # a scale rounded down by up to 2^-9 could give 128
            tmp.clamp_(-127, 127)
        q[start:start + rows].copy_(tmp)  # exact in int8


def _dequantize(q: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """q (n, block) int8, scales (n,) float32 -> out (n, block) float32, two passes, no temporaries."""
    if q.numel():
        out.copy_(q)
        out.mul_(scales[:, None])
