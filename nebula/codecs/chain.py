"""Composition `outer(inner)`, the paper's C_FP16(C_SVD(x, r)) (Eq. 5): the inner codec runs first and
the outer one re-encodes each floating-point part it produced; other parts (topk's int32 indices)
pass through. Wire: the parts of each inner part's encoding, in order. Meta:
{"i": inner meta, "o": [[n_j, outer meta_j] for a re-encoded part, or null for a passed-through one]}.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from nebula.codecs.base import FLOAT_DTYPES, MAX_DECODED_NUMEL, Codec, Meta, Parts, format_call, spec_args
from nebula.errors import CodecError

MAX_GROUPS = 16  # the inner codecs make at most 3 parts (svd: U, S, V); nested chains a few more


@dataclass(frozen=True)
class Chain(Codec):
    outer: Codec
    inner: Codec

    @property
    def spec(self) -> str:
        return format_call(self.outer.name, [self.inner.spec, *spec_args(self.outer)])

    @property
    def needs_ids(self) -> bool:
        return self.inner.needs_ids  # the outer codec sees the inner one's parts, not the rows

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        inner_parts, inner_meta = self.inner.encode(x, _sub(state, "inner"), ids=ids)
        parts: Parts = []
        groups: list[list[Any] | None] = []  # [part count, outer meta] per inner part, None: passed through
        for j, part in enumerate(inner_parts):
            if part.dtype in FLOAT_DTYPES:
                encoded, meta = self.outer.encode(part, _sub(state, f"outer{j}"))
                parts += encoded
                groups.append([len(encoded), meta])
            else:
                parts.append(part)
                groups.append(None)
        return parts, {"i": inner_meta, "o": groups}

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        inner_meta, groups = meta.get("i"), meta.get("o")
        if not isinstance(inner_meta, dict) or not isinstance(groups, list):
            raise CodecError(f"codec {self.spec!r}: meta needs a dict 'i' and a list 'o', got {meta!r:.200}")
        if len(groups) > MAX_GROUPS:
            raise CodecError(f"codec {self.spec!r}: meta 'o' lists {len(groups)} parts, more than {MAX_GROUPS}")
        limit = _parts_limit(inner_meta)
        inner_parts: list[torch.Tensor | None] = []  # None: a passed-through part past the message's end
        pos = decoded = 0
        for group in groups:
            if group is None:
                inner_parts.append(parts[pos] if pos < len(parts) else None)
                pos += 1
                continue
            if not (isinstance(group, list) and len(group) == 2 and type(group[0]) is int and group[0] >= 0
                    and isinstance(group[1], dict)):
                raise CodecError(f"codec {self.spec!r}: meta 'o' entry must be [count, dict], got {group!r:.200}")
            declared = _numel(group[1])  # counted before decoding where the meta says (topk, svd: they expand)
            if decoded + (declared or 0) > limit:
                raise CodecError(f"codec {self.spec!r}: its parts would decode to more than {limit} elements")
            outer_decoded = self.outer.decode(parts[pos:pos + group[0]], group[1])
            inner_parts.append(outer_decoded)
            pos += group[0]
            decoded += outer_decoded.numel()
            if decoded > limit:
                raise CodecError(f"codec {self.spec!r}: its parts decode to more than {limit} elements")
        if pos != len(parts):
            raise CodecError(f"codec {self.spec!r}: meta accounts for {pos} parts, the message has {len(parts)}")
        # pos == len(parts): every passed-through part was in the message, and the filter drops nothing
        return self.inner.decode([part for part in inner_parts if part is not None], inner_meta)


def _numel(meta: dict) -> int | None:
    shape = meta.get("shape")
    if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape):
        return math.prod(shape)
    return None


def _parts_limit(inner_meta: dict) -> int:
    """Elements the inner codec's parts may hold in all: a few times the tensor it decodes to, where its
    meta gives the shape (svd's U and V hold at most twice the matrix), and never more than one message."""
    numel = _numel(inner_meta)
    return MAX_DECODED_NUMEL if numel is None else min(MAX_DECODED_NUMEL, 4 * numel + 4096)


def _sub(state: dict | None, key: str) -> dict | None:
    return None if state is None else state.setdefault(key, {})
