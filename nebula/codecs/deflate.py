"""`deflate(level=6)`: lossless zlib compression, for index-only links (token ids, labels, masks).

Before zlib, a transform that lines the bytes up for it:
- integers wider than a byte (int32, int64): zigzag LEB128 varints, 7 bits per byte, low group first
  (byte bit 7 = another byte follows): an id below 64 is one byte, below 8192 two (zigzag doubles
  non-negative values); with a
  frequency-ordered vocabulary most tokens are one or two bytes before zlib even starts. Where the
  varints would be longer than the raw bytes (64-bit hashes), the byte shuffle instead, and meta
  says so ("shuffle": true);
- floats: blosc's byte shuffle (byte k of every element together: for itemsize s, the (N, s) bytes
  transposed to (s, N)), so exponent bytes meet exponent bytes;
- one-byte dtypes (uint8, int8, bool): as they are.
Any wire dtype, bit-exact. Wire: part 0 = the zlib stream, uint8 (compressed bytes,).
Meta: {"dtype": name, "shape": [...]} (+ "shuffle": true for an integer tensor sent shuffled) (decoding sees
only parts and meta, not the payload header).
Bytes: data-dependent; real packed ELECTRA sequences (128 tokens, a 28,902-id frequency-ordered
vocabulary), int32 (8, 128): 1.27 bytes per token (1.46 with the byte shuffle, 4 raw).
"""
from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from nebula.codecs.base import (
    MAX_DECODED_NUMEL,
    Codec,
    Meta,
    Parts,
    check_part,
    check_parts,
    meta_shape,
    register_codec,
)
from nebula.errors import CodecError, ConfigError
from nebula.wire import ITEMSIZE, dtype_names, torch_dtypes

# what one raw message could carry (base.MAX_DECODED_NUMEL float32s), whatever the dtype: the bound on
# the bytes a network meta may make us inflate
MAX_DECODED_BYTES = MAX_DECODED_NUMEL * 4


@register_codec("deflate")
@dataclass(frozen=True)
class Deflate(Codec):
    """Decoding inflates at most the byte count meta implies, plus one: a zip bomb costs nothing."""

    exact = True
    level: int = 6

    def __post_init__(self) -> None:
        if type(self.level) is not int or not 1 <= self.level <= 9:
            raise ConfigError(f"codec 'deflate': level={self.level!r} must be an integer in 1..9 "
                              "(1 fastest, 9 smallest), e.g. deflate(level=6)")

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        if x.dtype not in dtype_names():
            raise CodecError(f"codec 'deflate': dtype {x.dtype} cannot go on the wire "
                             f"(allowed: {', '.join(ITEMSIZE)})")
        flat = x.detach().cpu().contiguous().reshape(-1)  # (N,): a 0-d tensor cannot be viewed as bytes
        if flat.numel() <= 1 and flat.stride(-1) != 1:  # torch calls a 0- or 1-element tensor contiguous
            flat = flat.clone(memory_format=torch.contiguous_format)  # at any stride; bytes need stride 1
        dtype = dtype_names()[x.dtype]
        meta: Meta = {"dtype": dtype, "shape": list(x.shape)}
        data = _varints(flat) if _is_varint(dtype) else None
        if data is None or len(data) > flat.numel() * flat.element_size():  # hashes: varints would only grow
            data = flat.view(torch.uint8).view(-1, flat.element_size()).t().contiguous().numpy()  # (s, N)
            meta["shuffle"] = True
        packed = bytearray(zlib.compress(data.data, self.level))  # writable: no read-only tensor
        return [torch.frombuffer(packed, dtype=torch.uint8)], meta

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        check_parts("deflate", parts, 1)
        check_part("deflate", parts[0], "part 0 (zlib stream)", (torch.uint8,), ndim=1)
        dtype, shape = _meta_dtype(meta), meta_shape("deflate", meta)
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if expected > MAX_DECODED_BYTES:
            raise CodecError(f"codec 'deflate': meta {dtype} {list(shape)} is {expected} bytes, over the limit "
                             f"of {MAX_DECODED_BYTES}")
        what = f"{dtype} {list(shape)}"
        if _is_varint(dtype) and meta.get("shuffle") is not True:
            numel = math.prod(shape)
            out = _from_varints(_inflate(parts[0], numel * VARINT_MAX[dtype], what, exact=False), numel, dtype)
            return out.view(shape)
        raw = _inflate(parts[0], expected, what)
        out = _unshuffle(raw, ITEMSIZE[dtype])
        # a bool byte other than 0/1 is not a value torch defines: refused rather than passed on
        if dtype == "bool" and out.numel() and int(out.max()) > 1:
            raise CodecError("codec 'deflate': bool tensor has bytes other than 0 and 1")
        return out.view(torch_dtypes()[dtype]).view(shape)


def _meta_dtype(meta: Meta) -> str:
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CodecError(f"codec 'deflate': meta['dtype'] must be one of {', '.join(ITEMSIZE)}, got {dtype!r:.100}")
    return dtype


def _inflate(part: torch.Tensor, expected: int, what: str, exact: bool = True) -> bytes:
    """Exactly (`exact`) or at most `expected` bytes from one complete zlib stream, or CodecError (never
    zlib.error)."""
    stream = zlib.decompressobj()
    try:
        # one byte over the limit tells "longer than meta says" from "exactly right" without inflating more
        raw = stream.decompress(part.contiguous().numpy().data, expected + 1)
    except zlib.error as exc:
        raise CodecError(f"codec 'deflate': part 0 is not a valid zlib stream ({exc})") from exc
    if len(raw) > expected:
        raise CodecError(f"codec 'deflate': part 0 inflates to more than the {expected} bytes of {what}")
    if len(raw) < expected and exact:
        raise CodecError(f"codec 'deflate': part 0 inflates to {len(raw)} bytes, {what} needs {expected}")
    if not stream.eof:  # the stream's checksum was never read
        raise CodecError(f"codec 'deflate': part 0 is a truncated zlib stream ({len(part)} bytes)")
    if stream.unused_data:
        raise CodecError(f"codec 'deflate': part 0 has {len(stream.unused_data)} bytes after the zlib stream")
    return raw


def _unshuffle(raw: bytes, itemsize: int) -> torch.Tensor:
    """The (s, N) byte planes back to (N * s,) element bytes, in a fresh writable tensor."""
    out = torch.empty(len(raw) // itemsize, itemsize, dtype=torch.uint8)
    if raw:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": only read, by the copy
            out.copy_(torch.frombuffer(raw, dtype=torch.uint8).view(itemsize, -1).t())
    return out.view(-1)


VARINT_MAX = {"int32": 5, "int64": 10}  # bytes of the longest zigzag varint of the dtype


def _is_varint(dtype: str) -> bool:
    return dtype in VARINT_MAX


def _varints(flat: torch.Tensor) -> np.ndarray:
    """Zigzag LEB128 of every element, element after element: (total bytes,) uint8."""
    a = flat.numpy().astype(np.int64)
    z = ((a << 1) ^ (a >> 63)).view(np.uint64)  # zigzag: small magnitudes, either sign, are small
    count = np.ones(len(z), dtype=np.int64)
    for k in range(1, 10):
        count += z >= np.uint64(1 << (7 * k))
    width = int(count.max()) if len(z) else 1
    groups = np.stack([(z >> np.uint64(7 * k)) & np.uint64(127) for k in range(width)], 1).astype(np.uint8)
    group = np.arange(width)[None, :]  # (1, width)
    groups |= ((group < count[:, None] - 1) * 128).astype(np.uint8)  # "another byte follows"
    return groups[group < count[:, None]]  # row-major: element after element


VARINT_CHUNK = 1 << 20  # bytes decoded at once: the vector decode needs ~60 B of temporaries per byte


def _from_varints(raw: bytes, numel: int, dtype: str) -> torch.Tensor:
    """The elements of `raw`'s zigzag varints, decoded a chunk at a time into the output, so that a
    stream of small values (a 64 KB zlib stream of zeros holds 2^26 of them) costs the output's memory,
    not 60 times the element count."""
    b = np.frombuffer(raw, dtype=np.uint8)
    complete = int(np.count_nonzero(b < 128))  # bytes without "another follows": one per element
    if complete != numel or (len(b) and b[-1] >= 128):
        raise CodecError(f"codec 'deflate': part 0 holds {complete} complete varints, meta says {numel}")
    out = np.empty(numel, dtype=np.int32 if dtype == "int32" else np.int64)
    start = done = 0
    while start < len(b):
        stop = min(start + VARINT_CHUNK, len(b))
        ends = np.flatnonzero(b[start:stop] < 128)
        if not len(ends):
            raise CodecError(f"codec 'deflate': a varint longer than {VARINT_MAX[dtype]} bytes for {dtype}")
        stop = start + int(ends[-1]) + 1  # the chunk ends with its last whole varint
        values = _varint_chunk(b[start:stop], len(ends), dtype)
        out[done:done + len(values)] = values
        start, done = stop, done + len(values)
    return torch.from_numpy(out)


def _varint_chunk(b: np.ndarray, numel: int, dtype: str) -> np.ndarray:
    """int64 values of `numel` whole varints in `b`, vectorised."""
    last = b < 128  # the last byte of an element
    element = np.concatenate([[0], np.cumsum(last)[:-1]]).astype(np.int64)  # which element each byte is of
    starts = np.concatenate([[0], np.flatnonzero(last)[:-1] + 1])
    position = np.arange(len(b)) - starts[element]
    if int(position.max()) >= VARINT_MAX[dtype]:
        raise CodecError(f"codec 'deflate': a varint longer than {VARINT_MAX[dtype]} bytes for {dtype}")
    z = np.zeros(numel, dtype=np.uint64)
    for k in range(VARINT_MAX[dtype]):
        at = position == k  # at most one byte per element at each position: plain assignment suffices
        z[element[at]] |= (b[at] & 127).astype(np.uint64) << np.uint64(7 * k)
    a = (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)
    if dtype == "int32" and (a.min() < -(1 << 31) or a.max() >= 1 << 31):
        raise CodecError("codec 'deflate': a varint outside the int32 range")
    return a
