"""Composition `outer(inner)`, the paper's C_FP16(C_SVD(x, r)) (Eq. 5): the inner codec runs first and
the outer one re-encodes each floating-point part it produced; other parts (topk's int32 indices)
pass through. Wire: the parts of each inner part's encoding, in order. Meta:
{"i": inner meta, "o": [[n_j, outer meta_j] for a re-encoded part, or null for a passed-through one]}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nebula.codecs.base import FLOAT_DTYPES, Codec, Meta, Parts, format_call, spec_args
from nebula.errors import CodecError


@dataclass(frozen=True)
class Chain(Codec):
    outer: Codec
    inner: Codec

    @property
    def spec(self) -> str:
        return format_call(self.outer.name, [self.inner.spec, *spec_args(self.outer)])

    def encode(self, x: torch.Tensor, state: dict | None = None) -> tuple[Parts, Meta]:
        inner_parts, inner_meta = self.inner.encode(x, _sub(state, "inner"))
        parts, groups = [], []
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
        inner_parts, pos = [], 0
        for group in groups:
            if group is None:
                inner_parts.append(parts[pos] if pos < len(parts) else None)
                pos += 1
                continue
            if not (isinstance(group, list) and len(group) == 2 and type(group[0]) is int and group[0] >= 0
                    and isinstance(group[1], dict)):
                raise CodecError(f"codec {self.spec!r}: meta 'o' entry must be [count, dict], got {group!r:.200}")
            inner_parts.append(self.outer.decode(parts[pos:pos + group[0]], group[1]))
            pos += group[0]
        if pos != len(parts):
            raise CodecError(f"codec {self.spec!r}: meta accounts for {pos} parts, the message has {len(parts)}")
        return self.inner.decode(inner_parts, inner_meta)


def _sub(state: dict | None, key: str) -> dict | None:
    return None if state is None else state.setdefault(key, {})
