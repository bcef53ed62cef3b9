"""`delta(inner, mb=1024, first=None)`: send the change of each example's activation since its previous
visit (AQ-SGD, Wang et al., NeurIPS 2022), compressed with `inner`; rows with no base go through `first`
(default `inner`): a first visit carries the whole activation, not a small change, and what it loses
stays in the base every later delta is taken against.

Rows of x (its first dimension) are examples; the caller hands their (B,) int64 id hashes to `pack`.
Both ends keep, per stream, the last *decoded* value of each example (a `RowCache`, LRU by bytes:
4 per element and ENTRY_BYTES per entry, capped at `mb` MiB by the spec, so both ends evict alike).
The sender decodes what it sent, exactly as the receiver will, so the two caches hold bit-identical
bases. A row whose example has a base that fits it goes as x_row - base ("delta"), any other row as
x_row ("direct": first visit, evicted, or another shape). A base fits a row of its own shape, or of
its shape but for the first dimension (another padded length of a sequence), cut or zero-extended to
the row's. Every base carries the sequence number of the message that wrote it; a delta row names
it, and a receiver that holds no base or another one for that example refuses the whole message
(CodecError) before changing anything. Since each delta is taken against what the receiver holds,
the previous visit's quantisation error is part of the next delta: errors never pile up.

Wire: part 0 = ids int64 (B,); part 1 = base seq int64 (B,), 0 for a direct row; then `first`'s
parts for the stacked direct rows, then `inner`'s for the stacked delta rows (a group with no rows has
none). Meta: {"seq": this message's number, "row": one example's shape, "d": [parts, first's meta] or
null, "r": [parts, inner meta] or null}. Layout and rules: docs/protocol.md §3.7.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nebula.codecs.base import (
    WIRE_FLOATS,
    Codec,
    Meta,
    Parts,
    check_part,
    meta_shape,
    register_codec,
    require_float,
)
from nebula.codecs.spill import SpillFile
from nebula.errors import CodecError, ConfigError

MIB = 1 << 20
# What a cache entry counts against the cap besides its float32 elements: its Python and torch objects
# (id, seq, tensor, storage, dict slot) take about 620 B for a row of no elements and 730 B for one
# (measured with CPython 3.11, torch 2.13). Without it, rows of few or no elements cost next to nothing
# against the cap, and a peer could grow the receiver's memory without bound. Part of the protocol
# (docs/protocol.md §3.7): both ends must evict alike.
ENTRY_BYTES = 1024
log = logging.getLogger(__name__)


class RowCache:
    """Last decoded row per example id, least recently used first; bounded by bytes: 4 per element of
    each row plus ENTRY_BYTES per entry (`bytes` in the stats counts the rows' elements only).

    Both ends run the same operations in the same order (read the delta rows' bases, touch them, then put every row), so
    with the same cap their contents and evictions stay identical. Where the rows live does not change
    which rows there are: past `ram_bytes` the least recently used ones move to a `SpillFile` (the
    older rows all on disk, the newer all in memory) and come back to memory when touched.
    A row that cannot be written to disk (a full disk) stays in memory, over `ram_bytes`, and the
    cache says so once in the log: a row lost at one end would put the two caches out of step."""

    def __init__(self, cap_bytes: int, ram_bytes: int | None = None, spill_dir: str | Path | None = None):
        self.cap_bytes = cap_bytes
        self.ram_cap = cap_bytes if ram_bytes is None else min(ram_bytes, cap_bytes)
        self.spill_dir = spill_dir
        self._rows: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()  # id -> (seq, row), newer
        self._disk: OrderedDict[int, tuple[int, torch.Size, list[int]]] = OrderedDict()  # id -> (seq, shape, blocks)
        self._spill: SpillFile | None = None
        self.bytes = self.ram_bytes = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0, "spilled": 0, "read_back": 0}
        self._spill_failed = False

    def entry(self, key: int) -> tuple[int, torch.Size] | None:
        """(seq, shape) of the example's row, wherever it lives; None if there is none."""
        if key in self._rows:
            seq, row = self._rows[key]
            return seq, row.shape
        held = self._disk.get(key)
        return None if held is None else held[:2]

    def get(self, key: int) -> tuple[int, torch.Tensor] | None:
        """(seq, row), read back from disk if it lives there; does not change the LRU order."""
        if key in self._rows:
            return self._rows[key]
        held = self._disk.get(key)
        return None if held is None else (held[0], self._read(*held))

    def held(self, key: int) -> tuple[int, torch.Tensor]:
        """`get` for an example the cache holds: one of its own keys, or one `entry` has found."""
        got = self.get(key)
        assert got is not None, f"example {key:#x} is not in the cache"  # the callers looked it up first
        return got

    def touch(self, key: int, row: torch.Tensor) -> None:
        """Make the example the most recently used (back in memory if it was on disk); `row` is its
        row, already read with `get`."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return
        seq, shape, blocks = self._disk.pop(key)
        self._spilled.free(blocks, shape)
        self.counts["read_back"] += 1
        self._rows[key] = (seq, row)
        self.ram_bytes += row.numel() * 4
        self._demote()

    def put(self, key: int, seq: int, row: torch.Tensor) -> None:
        self._drop(key)
        self._rows[key] = (seq, row)
        self.bytes += row.numel() * 4
        self.ram_bytes += row.numel() * 4
        while self.bytes + ENTRY_BYTES * len(self) > self.cap_bytes and (self._disk or self._rows):
            self._drop(next(iter(self._disk or self._rows)))  # the least recently used: disk's oldest first
            self.counts["evictions"] += 1
        self._demote()

    def _drop(self, key: int) -> None:
        if key in self._rows:
            _, row = self._rows.pop(key)
            self.bytes -= row.numel() * 4
            self.ram_bytes -= row.numel() * 4
        elif key in self._disk:
            _, shape, blocks = self._disk.pop(key)
            self._spilled.free(blocks, shape)
            self.bytes -= shape.numel() * 4

    def _demote(self) -> None:
        """Move the least recently used rows in memory to disk until memory holds at most ram_cap."""
        while self.ram_bytes > self.ram_cap and self._rows:
            key, (seq, row) = next(iter(self._rows.items()))
            try:
                if self._spill is None:
                    self._spill = SpillFile(self.spill_dir)
                blocks = self._spill.write(row)
            except OSError as exc:
                if not self._spill_failed:
                    log.warning("delta cache: cannot spill rows to disk (%s); keeping them in memory, "
                                "%d MiB over the %d MiB asked for", exc, (self.ram_bytes - self.ram_cap) >> 20,
                                self.ram_cap >> 20)
                self._spill_failed = True
                return
            del self._rows[key]
            self._disk[key] = (seq, row.shape, blocks)
            self.ram_bytes -= row.numel() * 4
            self.counts["spilled"] += 1
        self._spill_failed = False

    @property
    def _spilled(self) -> SpillFile:
        """The spill file, for a row on disk."""
        assert self._spill is not None  # a row is on disk only once the spill file exists
        return self._spill

    def _read(self, seq: int, shape: torch.Size, blocks: list[int]) -> torch.Tensor:
        try:
            return self._spilled.read(blocks, shape)
        except OSError as exc:
            raise CodecError(f"delta cache: the spilled row of message {seq} cannot be read back ({exc})") from exc

    def __len__(self) -> int:
        return len(self._rows) + len(self._disk)

    def stats(self) -> dict[str, int]:
        """hits, misses, evictions, rows spilled to disk and read back (since creation); the entries and
        bytes held now, those in memory and on disk, the spill file's size; the caps."""
        return {**self.counts, "entries": len(self), "bytes": self.bytes, "cap_bytes": self.cap_bytes,
                "ram_bytes": self.ram_bytes, "ram_cap_bytes": self.ram_cap,
                "disk_bytes": self._spill.bytes if self._spill else 0,
                "disk_file_bytes": self._spill.end if self._spill else 0}

    def close(self) -> None:
        """Free the spill file now rather than when the cache is collected."""
        if self._spill is not None:
            self._spill.close()

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and ints (loads with torch.load(weights_only=True)), least recent first;
        spilled rows are read back into it."""
        keys = [*self._disk, *self._rows]
        entries = [self.held(key) for key in keys]
        return {"cap_bytes": self.cap_bytes, "ram_cap_bytes": self.ram_cap,
                "ids": torch.tensor(keys, dtype=torch.int64),
                "seqs": torch.tensor([s for s, _ in entries], dtype=torch.int64),
                "rows": [r for _, r in entries], "counts": dict(self.counts)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.close()
        RowCache.__init__(self, int(saved["cap_bytes"]), int(saved.get("ram_cap_bytes", saved["cap_bytes"])),
                          self.spill_dir)
        for key, seq, row in zip(saved["ids"].tolist(), saved["seqs"].tolist(), saved["rows"]):
            self.put(key, seq, row)
        self.counts = {**self.counts, **saved["counts"]}


@register_codec("delta")
@dataclass(frozen=True)
class Delta(Codec):
    inner: Codec
    mb: int = 1024  # cache cap per stream, MiB (RowCache counts rows and entries), the same at both ends
    first: Codec | None = None  # for rows with no base (first visit, evicted, another shape); None: inner
    ram: int | None = None  # MiB of the mb held in memory, the rest spilled to disk; None: all of it

    def __post_init__(self) -> None:
        if type(self.mb) is not int or not 1 <= self.mb <= 1 << 20:
            raise ConfigError(f"codec 'delta': mb={self.mb!r} must be an integer in 1..1048576 (MiB of cached "
                              "activations per stream), e.g. delta(int8, mb=1024)")
        if self.ram is not None and (type(self.ram) is not int or not 0 <= self.ram <= self.mb):
            raise ConfigError(f"codec 'delta': ram={self.ram!r} must be an integer in 0..mb ({self.mb}): the MiB of "
                              "cached rows kept in memory, the rest on disk, e.g. delta(int8, mb=8192, ram=1024)")
        if isinstance(self.first, Delta) or isinstance(self.inner, Delta):
            raise ConfigError("codec 'delta' cannot hold another delta: its rows' bases are per example already")
        # Values equal to the defaults are the defaults: one codec, one canonical spec (streams are keyed by it,
        # so `delta(int8, first=int8)` and `delta(int8)` must not empty both ends' caches at a switch).
        if self.first == self.inner:
            object.__setattr__(self, "first", None)
        if self.ram == self.mb:
            object.__setattr__(self, "ram", None)

    @property
    def needs_ids(self) -> bool:
        return True  # each row's base is its example's last decoded row

    @property
    def direct(self) -> Codec:
        """The codec of the rows sent whole."""
        return self.inner if self.first is None else self.first

    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        if state is None or not isinstance(ids, torch.Tensor):
            raise CodecError(f"codec {self.spec!r} needs a state and the rows' example ids: "
                             "pack(..., state=codec_state.slot(link, name), ids=example_ids); "
                             "use it on activations that come with example ids")
        require_float(self.spec, x)
        ids = _check_ids(self.spec, ids, x)
        x = x.detach().cpu().float()  # (B, ...)
        cache = self._cache(state)
        seq = state["seq"] = state.get("seq", 0) + 1
        tags = torch.zeros(len(ids), dtype=torch.int64)
        for i, key in enumerate(ids.tolist()):
            entry = cache.entry(key)
            if entry is not None and fits(entry[1], x.shape[1:]):
                tags[i] = entry[0]
        held, bases = self._bases(cache, ids, tags, x.shape[1:])
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
        _commit(cache, ids, held, seq, out)
        return parts, meta

    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        raise CodecError(f"codec {self.spec!r} applies differences to the receiver's cached rows: decode it with "
                         "unpack(payload, state=...), one state per (link, tensor)")

    def decode_with_state(self, parts: Parts, meta: Meta, state: dict | None,
                          shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode against the receiver's cache, which changes only once the whole message decoded: a
        refused message (CodecError) leaves its entries, their order and its counts as they were."""
        if state is None:
            return self.decode(parts, meta)
        if dtype is not None and dtype not in WIRE_FLOATS:  # `unpack` would refuse the float32 rows after the commit
            raise CodecError(f"codec {self.spec!r} decodes float32 rows, the header says "
                             f"{str(dtype).removeprefix('torch.')}: send the activation's own float dtype in the "
                             "header")
        if len(parts) < 2:
            raise CodecError(f"codec {self.spec!r}: expected ids and base parts first, got {len(parts)} parts")
        ids, tags = parts[0], parts[1]
        check_part(self.spec, ids, "part 0 (ids)", (torch.int64,), ndim=1)
        check_part(self.spec, tags, "part 1 (bases)", (torch.int64,), ndim=1)
        seq, row = meta.get("seq"), meta.get("row")
        if not isinstance(row, list):
            raise CodecError(f"codec {self.spec!r}: meta needs 'row', the shape of one example, got {row!r:.100}")
        header, shape = shape, meta_shape(self.spec, {"shape": [len(ids), *row]})
        if header is not None and math.prod(header) != math.prod(shape):
            raise CodecError(f"codec {self.spec!r}: {len(ids)} rows of {row} are not the header's shape {list(header)}")
        if type(seq) is not int or seq < 1 or tags.shape != ids.shape or bool((tags < 0).any()):
            raise CodecError(f"codec {self.spec!r}: meta 'seq' must be a positive int and part 1 one non-negative "
                             f"int64 per row, got seq={seq!r}, {tuple(tags.shape)} for {len(ids)} rows")
        cache = self._cache(state)
        for key, tag in zip(ids.tolist(), tags.tolist()):  # refuse before anything is applied
            entry = cache.entry(key)
            if tag and (entry is None or entry[0] != tag or not fits(entry[1], shape[1:])):
                has = "no base" if entry is None else f"the base of message {entry[0]} {tuple(entry[1])}"
                raise CodecError(f"codec {self.spec!r}: example {key:#x} is a delta against the base of message "
                                 f"{tag} {tuple(shape[1:])}, and this receiver holds {has}: the two caches are "
                                 "out of step; reset the link's codec state at both ends (a resume does)")
        held, bases = self._bases(cache, ids, tags, shape[1:])
        out = self._rebuild(list(parts[2:]), meta, tags, bases, shape)
        _commit(cache, ids, held, seq, out)
        return out

    def _cache(self, state: dict) -> RowCache:
        """The stream's cache; spilled rows go to the directory the runtime put in the state (a stage's
        run directory), else the system's temporary directory."""
        cache = state.get("cache")
        if not isinstance(cache, RowCache):
            ram = None if self.ram is None else self.ram * MIB
            cache = state["cache"] = RowCache(self.mb * MIB, ram, state.get("spill_dir"))
        return cache

    def _bases(self, cache: RowCache, ids: torch.Tensor, tags: torch.Tensor,
               row: tuple[int, ...]) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
        """The delta rows' (key, cached row as held), and the rows fitted and stacked (D, *row), in row
        order; reads only: `_commit` marks them used once the message is whole."""
        held = [(key, cache.held(key)[1]) for key, tag in zip(ids.tolist(), tags.tolist()) if tag]
        return held, (torch.stack([fit(h, row) for _, h in held]) if held else torch.zeros(0, *row))

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
            raise CodecError(f"codec {self.spec!r}: meta accounts for {pos + 2} parts, "
                             f"the message has {len(parts) + 2}")
        return out


def fits(base: tuple[int, ...], row: tuple[int, ...]) -> bool:
    """Whether a cached row of shape `base` can be the base of a row of shape `row`: the same shape, or
    the same but for the first dimension (another padded length of one sequence)."""
    return base == row or (len(base) == len(row) >= 1 and base[1:] == row[1:])


def fit(base: torch.Tensor, row: tuple[int, ...]) -> torch.Tensor:
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


def _commit(cache: RowCache, ids: torch.Tensor, held: list[tuple[int, torch.Tensor]], seq: int,
            out: torch.Tensor) -> None:
    """Both ends, once a message is whole: its delta rows' entries (`held`, from `_bases`) become the
    most recently used, in row order, then every row is stored (docs/protocol.md §3.7, step 4)."""
    for key, row in held:
        cache.touch(key, row)
    cache.counts["hits"] += len(held)
    cache.counts["misses"] += len(ids) - len(held)
    for i, key in enumerate(ids.tolist()):
        cache.put(key, seq, out[i].clone())  # a copy: `out` goes to the caller, who may write to it


def _check_ids(spec: str, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if ids.dtype != torch.int64 or ids.dim() != 1 or x.dim() < 1 or ids.shape[0] != x.shape[0]:
        raise CodecError(f"codec {spec!r}: ids must be int64 (B,) for x's B = first dimension rows, got "
                         f"{ids.dtype} {tuple(ids.shape)} for x {tuple(x.shape)}")
    return ids.detach().cpu().contiguous()

