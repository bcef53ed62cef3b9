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

from nebula.codecs.base import Codec, Meta, Parts, check_part, check_parts, register_codec, require_float
from nebula.errors import CodecError, ConfigError

SCALE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32 scratch: fits in L2+L3 alongside its inputs


@register_codec("int8")
@dataclass(frozen=True)
class Int8(Codec):
    block: int = 64
    scale: str = "fp32"

    def __post_init__(self) -> None:
        check_block_and_scale("int8", self.block, self.scale)

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        require_float("int8", x)
        q, scales = quantize("int8", x, self.block, self.scale, 127)
        return [q.view(x.shape), scales], {}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("int8", parts, 2)
        q, scales = parts
        check_part("int8", q, "part 0 (values)", (torch.int8,))
        return dequantize("int8", q, scales, self.block)


def check_block_and_scale(codec: str, block: object, scale: object) -> None:
    if type(block) is not int or not 1 <= block <= 1 << 20:
        raise ConfigError(f"codec {codec!r}: block={block!r} must be an integer in 1..1048576, e.g. 64")
    if scale not in SCALE_DTYPES:
        raise ConfigError(f"codec {codec!r}: scale={scale!r} must be one of {', '.join(SCALE_DTYPES)}")


def quantize(codec: str, x: torch.Tensor, block: int, scale: str, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (q, scales): q (numel,) int8 in -levels..levels, one scale per block of `block` elements
    (the last may be short), in the `scale` dtype; shared by `int8` (levels 127) and `int4` (7)."""
    flat = x.detach().cpu().reshape(-1).float()  # no copy for a contiguous float32 tensor
    nblocks, nfull = -(-flat.numel() // block), flat.numel() // block
    q = torch.empty(flat.numel(), dtype=torch.int8)
    scales = torch.empty(nblocks, dtype=SCALE_DTYPES[scale])
    _quantize(flat[:nfull * block].view(nfull, block), q[:nfull * block].view(nfull, block), scales[:nfull], levels)
    if nfull < nblocks:  # the short last block
        _quantize(flat[nfull * block:].view(1, -1), q[nfull * block:].view(1, -1), scales[nfull:], levels)
    if not torch.isfinite(scales).all():
        raise CodecError(f"codec {codec!r}: tensor has NaN/Inf values (or |x| beyond the range of "
                         f"{scale} scales); fix the producer or send it with codec 'none'")
    return q, scales


def dequantize(codec: str, q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """q (any shape) int8 and its blocks' scales -> float32 of q's shape; the scale count is checked."""
    check_part(codec, scales, "part 1 (scales)", tuple(SCALE_DTYPES.values()), ndim=1)
    numel, nfull = q.numel(), q.numel() // block
    if scales.numel() != -(-numel // block):
        raise CodecError(f"codec {codec!r}: {scales.numel()} scales for {numel} values in blocks of {block}, "
                         f"expected {-(-numel // block)}")
    out = torch.empty(q.shape, dtype=torch.float32)
    flat_q, flat_out, s32 = q.reshape(-1), out.view(-1), scales.float()
    _dequantize(flat_q[:nfull * block].view(nfull, block), flat_out[:nfull * block].view(nfull, block), s32[:nfull])
    _dequantize(flat_q[nfull * block:].view(1, -1), flat_out[nfull * block:].view(1, -1), s32[nfull:])
    return out


def _quantize(blocks: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, levels: int) -> None:
    """blocks (n, block) float32 -> q (n, block) int8 and scales (n,), chunk by chunk."""
    if blocks.numel() == 0:
        return
    rows = max(1, CHUNK_ELEMENTS // blocks.shape[1])
    scratch = torch.empty(min(rows, blocks.shape[0]), blocks.shape[1])
    for start in range(0, blocks.shape[0], rows):
        chunk = blocks[start:start + rows]  # (r, block)
        tmp = scratch[:chunk.shape[0]]
        torch.abs(chunk, out=tmp)
        scale = tmp.amax(1).div_(levels).to(scales.dtype)  # (r,)
        scales[start:start + rows] = scale
        inverse = torch.nan_to_num_(scale.float().reciprocal_(), posinf=0.0)  # all-zero block: scale 0
        torch.mul(chunk, inverse[:, None], out=tmp).round_()
        if scales.dtype != torch.float32:  # a scale rounded down by up to 2^-9 could give levels + 1
            tmp.clamp_(-levels, levels)
        q[start:start + rows].copy_(tmp)  # exact in int8


def _dequantize(q: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """q (n, block) int8, scales (n,) float32 -> out (n, block) float32, two passes, no temporaries."""
    if q.numel():
        out.copy_(q)
        out.mul_(scales[:, None])
