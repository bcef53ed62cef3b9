"""`delta(inner, mb=1024, first=None)`: send the change of each example's activation since its previous
visit (AQ-SGD, Wang et al., NeurIPS 2022), compressed with `inner`; rows with no base go through `first`
(default `inner`): a first visit carries the whole activation, not a small change, and what it loses
stays in the base every later delta is taken against.

Rows of x (its first dimension) are examples; the caller hands their (B,) int64 id hashes to `pack`.
Both ends keep, per stream, the last *decoded* value of each example (a `RowCache`, LRU by bytes,
capped at `mb` MiB by the spec, so both ends evict alike). The sender decodes what it sent, exactly
as the receiver will, so the two caches hold bit-identical bases. A row whose example has a base that
fits it goes as x_row - base ("delta"), any other row as x_row ("direct": first visit, evicted, or
another shape). A base fits a row of its own shape, or of its shape but for the first dimension
(another padded length of a sequence), cut or zero-extended to the row's. Every base carries the
sequence number of the message that wrote it; a delta row names it, and a receiver that holds no
base or another one for that example refuses the whole message (CodecError) before changing anything.
Since each delta is taken against what the receiver holds, the previous visit's quantisation error is
part of the next delta: errors never pile up.

Wire: part 0 = ids int64 (B,); part 1 = base seq int64 (B,), 0 for a direct row; then `first`'s
parts for the stacked direct rows, then `inner`'s for the stacked delta rows (a group with no rows has
none). Meta: {"seq": this message's number, "row": one example's shape, "d": [parts, first's meta] or
null, "r": [parts, inner meta] or null}. Layout and rules: docs/protocol.md §3.7.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from nebula.codecs.base import Codec, Meta, Parts, check_part, meta_shape, register_codec, require_float
from nebula.errors import CodecError, ConfigError

MIB = 1 << 20


class RowCache:
    """Last decoded row per example id, least recently used first; bounded by bytes (float32 rows).

    Both ends run the same operations in the same order (touch the delta rows, then put every row), so
    with the same cap their contents and evictions stay identical."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self._rows: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()  # id -> (seq, row)
        self.bytes = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0}

    def get(self, key: int) -> tuple[int, torch.Tensor] | None:
        return self._rows.get(key)

    def touch(self, key: int) -> None:
        self._rows.move_to_end(key)

    def put(self, key: int, seq: int, row: torch.Tensor) -> None:
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old[1].numel() * 4
        self._rows[key] = (seq, row)
        self.bytes += row.numel() * 4
        while self.bytes > self.cap_bytes and self._rows:
            _, (_, evicted) = self._rows.popitem(last=False)
            self.bytes -= evicted.numel() * 4
            self.counts["evictions"] += 1

    def __len__(self) -> int:
        return len(self._rows)

    def stats(self) -> dict[str, int]:
        """hits, misses, evictions (since creation), and the entries and bytes held now, the cap."""
        return {**self.counts, "entries": len(self._rows), "bytes": self.bytes, "cap_bytes": self.cap_bytes}

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints (loads with torch.load(weights_only=True)), least recent first."""
        return {"cap_bytes": self.cap_bytes, "ids": torch.tensor(list(self._rows), dtype=torch.int64),
                "seqs": torch.tensor([s for s, _ in self._rows.values()], dtype=torch.int64),
                "rows": [r for _, r in self._rows.values()], "counts": dict(self.counts)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.__init__(int(saved["cap_bytes"]))
        for key, seq, row in zip(saved["ids"].tolist(), saved["seqs"].tolist(), saved["rows"]):
            self.put(key, seq, row)
        self.counts = dict(saved["counts"])


@register_codec("delta")
@dataclass(frozen=True)
class Delta(Codec):
    inner: Codec
    mb: int = 1024  # cache cap per stream, MiB of float32 rows, the same at both ends (it is in the spec)
    first: Codec | None = None  # for rows with no base (first visit, evicted, another shape); None: inner

    def __post_init__(self) -> None:
        if type(self.mb) is not int or not 1 <= self.mb <= 1 << 20:
            raise ConfigError(f"codec 'delta': mb={self.mb!r} must be an integer in 1..1048576 (MiB of cached "
                              "activations per stream), e.g. delta(int8, mb=1024)")
        if isinstance(self.first, Delta) or isinstance(self.inner, Delta):
            raise ConfigError("codec 'delta' cannot hold another delta: its rows' bases are per example already")

    @property
    def direct(self) -> Codec:
        """The codec of the rows sent whole."""
        return self.inner if self.first is None else self.first

    def encode(self, x: torch.Tensor, state: dict | None = None) -> tuple[Parts, Meta]:
        if state is None or not isinstance(state.get("ids"), torch.Tensor):
            raise CodecError(f"codec {self.spec!r} needs a state and the rows' example ids: "
                             "pack(..., state=codec_state.slot(link, name), ids=example_ids); "
                             "use it on activations that come with example ids")
        require_float(self.spec, x)
        ids = _check_ids(self.spec, state.pop("ids"), x)
        x = x.detach().cpu().float()  # (B, ...)
        cache = _cache(state, self.mb)
        seq = state["seq"] = state.get("seq", 0) + 1
        tags = torch.zeros(len(ids), dtype=torch.int64)
        for i, key in enumerate(ids.tolist()):
            entry = cache.get(key)
            if entry is not None and fits(entry[1].shape, x.shape[1:]):
                tags[i] = entry[0]
        bases = self._bases(cache, ids, tags, x.shape[1:])
        delta = tags != 0
        parts, meta = [ids, tags], {"seq": seq, "row": list(x.shape[1:])}
        for key, rows, sub, codec in (("d", x[~delta], "direct", self.direct),
                                      ("r", x[delta] - bases, "delta", self.inner)):
            if rows.shape[0] == 0:
                meta[key] = None
                continue
            encoded, inner_meta = codec.encode(rows, state.setdefault(sub, {}))
            parts += encoded
            meta[key] = [len(encoded), inner_meta]
        out = self._rebuild(parts[2:], meta, tags, bases, x.shape)  # what the receiver will decode
        _remember(cache, ids, tags, seq, out)
        return parts, meta

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        raise CodecError(f"codec {self.spec!r} applies differences to the receiver's cached rows: decode it with "
                         "unpack(payload, state=...), one state per (link, tensor)")

    def decode_with_state(self, parts: Parts, meta: Meta, state: dict | None) -> torch.Tensor:
        if state is None:
            return self.decode(parts, meta)
        if len(parts) < 2:
            raise CodecError(f"codec {self.spec!r}: expected ids and base parts first, got {len(parts)} parts")
        ids, tags = parts[0], parts[1]
        check_part(self.spec, ids, "part 0 (ids)", (torch.int64,), ndim=1)
        check_part(self.spec, tags, "part 1 (bases)", (torch.int64,), ndim=1)
        seq, row = meta.get("seq"), meta.get("row")
        if not isinstance(row, list):
            raise CodecError(f"codec {self.spec!r}: meta needs 'row', the shape of one example, got {row!r:.100}")
        shape = meta_shape(self.spec, {"shape": [len(ids), *row]})
        if type(seq) is not int or seq < 1 or tags.shape != ids.shape or bool((tags < 0).any()):
            raise CodecError(f"codec {self.spec!r}: meta 'seq' must be a positive int and part 1 one non-negative "
                             f"int64 per row, got seq={seq!r}, {tuple(tags.shape)} for {len(ids)} rows")
        cache = _cache(state, self.mb)
        for key, tag in zip(ids.tolist(), tags.tolist()):  # refuse before anything is applied
            entry = cache.get(key)
            if tag and (entry is None or entry[0] != tag or not fits(entry[1].shape, shape[1:])):
                held = "no base" if entry is None else f"the base of message {entry[0]} {tuple(entry[1].shape)}"
                raise CodecError(f"codec {self.spec!r}: example {key:#x} is a delta against the base of message "
                                 f"{tag} {tuple(shape[1:])}, and this receiver holds {held}: the two caches are "
                                 "out of step; reset the link's codec state at both ends (a resume does)")
        bases = self._bases(cache, ids, tags, shape[1:])
        out = self._rebuild(list(parts[2:]), meta, tags, bases, shape)
        _remember(cache, ids, tags, seq, out)
        return out

    def _bases(self, cache: RowCache, ids: torch.Tensor, tags: torch.Tensor, row: torch.Size) -> torch.Tensor:
        """(D, *row) the cached rows of the delta rows, in row order; touches them (LRU), counts hits/misses."""
        rows = []
        for key, tag in zip(ids.tolist(), tags.tolist()):
            if tag:
                rows.append(fit(cache.get(key)[1], row))
                cache.touch(key)
        cache.counts["hits"] += len(rows)
        cache.counts["misses"] += len(ids) - len(rows)
        return torch.stack(rows) if rows else torch.zeros(0, *row)

    def _rebuild(self, parts: Parts, meta: Meta, tags: torch.Tensor, bases: torch.Tensor,
                 shape: torch.Size | tuple) -> torch.Tensor:
        """(B, ...) float32: the direct rows decoded, the delta rows base + decoded difference."""
        out, pos, delta = torch.empty(shape), 0, tags != 0
        for key, mask, add, codec in (("d", ~delta, None, self.direct), ("r", delta, bases, self.inner)):
            group, count = meta.get(key), int(mask.sum())
            if group is None and count == 0:
                continue
            if not (isinstance(group, list) and len(group) == 2 and type(group[0]) is int and group[0] >= 0
                    and isinstance(group[1], dict)):
                raise CodecError(f"codec {self.spec!r}: meta {key!r} must be [count, dict] for {count} rows, "
                                 f"got {group!r:.200}")
            rows = codec.decode(parts[pos:pos + group[0]], group[1]).reshape(count, *shape[1:])
            out[mask] = rows if add is None else add + rows
            pos += group[0]
        if pos != len(parts):
            raise CodecError(f"codec {self.spec!r}: meta accounts for {pos + 2} parts, the message has {len(parts) + 2}")
        return out


def fits(base: torch.Size, row: torch.Size) -> bool:
    """Whether a cached row of shape `base` can be the base of a row of shape `row`: the same shape, or
    the same but for the first dimension (another padded length of one sequence)."""
    return base == row or (len(base) == len(row) >= 1 and base[1:] == row[1:])


def fit(base: torch.Tensor, row: torch.Size) -> torch.Tensor:
    """`base` cut or zero-extended along its first dimension to `row`. Both ends fit alike, so the
    decoded row is x_row plus the inner codec's error whatever the fit; it pays off for sequences
    padded on the right (services/abnet's pad_rows), whose real positions come first and are in both:
    what it cuts or adds is padding, whose values the receiver masks anyway."""
    if base.shape == row:
        return base
    out = base.new_zeros(row)
    n = min(row[0], base.shape[0])
    out[:n] = base[:n]
    return out


def _cache(state: dict, mb: int) -> RowCache:
    cache = state.get("cache")
    if not isinstance(cache, RowCache):
        cache = state["cache"] = RowCache(mb * MIB)
    return cache


def _remember(cache: RowCache, ids: torch.Tensor, tags: torch.Tensor, seq: int, out: torch.Tensor) -> None:
    for i, key in enumerate(ids.tolist()):
        cache.put(key, seq, out[i].clone())  # a copy: `out` goes to the caller, who may write to it


def _check_ids(spec: str, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if ids.dtype != torch.int64 or ids.dim() != 1 or x.dim() < 1 or ids.shape[0] != x.shape[0]:
        raise CodecError(f"codec {spec!r}: ids must be int64 (B,) for x's B = first dimension rows, got "
                         f"{ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}")
    return ids.detach().cpu().contiguous()

