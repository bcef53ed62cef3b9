"""The two calls the rest of Nebula makes: tensor -> TensorPayload (`pack`) and back (`unpack`).

Meta travels as compact JSON (empty for codecs that need none) and is limited to 4 KB by the wire.
`unpack` trusts nothing in the payload: a bad spec, meta or part raises CodecError, never another
exception type, so a receiver can answer ERROR and keep running.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from nebula.codecs.base import WIRE_FLOATS, Codec
from nebula.codecs.spec import parse
from nebula.codecs.state import claim
from nebula.errors import CodecError, ConfigError, NebulaError
from nebula.wire import DEFAULT_LIMITS, ITEMSIZE, TensorPayload, dtype_names, torch_dtypes


def pack(name: str, role: str, x: torch.Tensor, codec: Codec | str,
         state: dict[str, Any] | None = None, ids: torch.Tensor | None = None,
         spill_dir: str | Path | None = None) -> TensorPayload:
    """Encode `x` for the wire. `state`: this stream's slot, `CodecState.slot(link, name)`;
    `ids`: the (B,) int64 example-id hashes of x's rows, for a codec that `needs_ids`; `spill_dir`: where
    `delta(..., ram=)` may spill its cached rows (default: the system's temporary directory)."""
    codec = parse(codec) if isinstance(codec, str) else codec
    if x.dtype not in dtype_names():
        raise CodecError(f"tensor {name!r}: dtype {x.dtype} cannot travel (allowed: "
                         f"{', '.join(ITEMSIZE)}); cast it to float32 first")
    parts, meta = codec.encode(x, _claim(state, codec.spec, spill_dir), ids=ids)
    parts = [part.contiguous() for part in parts]  # a no-op unless a kernel left a transposed layout
    meta_bytes = encode_meta(meta)
    if len(meta_bytes) > DEFAULT_LIMITS.max_meta_bytes:
        raise CodecError(f"tensor {name!r}: codec {codec.spec!r} meta is {len(meta_bytes)} bytes, over the "
                         f"{DEFAULT_LIMITS.max_meta_bytes}-byte limit")
    return TensorPayload(name=name, role=role, dtype=dtype_names()[x.dtype], shape=tuple(x.shape),
                         codec=codec.spec, meta=meta_bytes, parts=parts)


def unpack(payload: TensorPayload, state: dict[str, Any] | None = None,
           spill_dir: str | Path | None = None) -> torch.Tensor:
    """Decode a received payload into a tensor of payload.dtype and payload.shape. `state`: the
    receiver's slot for this stream (`CodecState.slot(link, name)` at the receiving end), which `delta`
    needs for its cached rows (and `spill_dir`, as for `pack`); every other codec decodes without one.

    With codec `none` (and a matching dtype) the result is the zero-copy, read-only view of the
    received frame: clone it before writing to it.
    """
    where = f"tensor {payload.name!r}"
    if payload.dtype not in ITEMSIZE:
        raise CodecError(f"{where}: unknown dtype {payload.dtype!r}")
    try:
        codec = parse(payload.codec)
    except ConfigError as exc:
        raise CodecError(f"{where}: {exc}") from exc
    if any(type(dim) is not int or dim < 0 for dim in payload.shape):
        raise CodecError(f"{where}: the header's shape {list(payload.shape)!r:.100} needs non-negative integers")
    # a message of another codec than the stream's empties its state only once it is accepted: decode it
    # against a fresh slot, and keep that one if it decodes (a refused message leaves the state as it was)
    slot = state if state is None or state.get("spec") == codec.spec else {}
    dtype = torch_dtypes()[payload.dtype]
    try:
        x = codec.decode_with_state(list(payload.parts), decode_meta(payload.meta),
                                    _claim(slot, codec.spec, spill_dir), shape=tuple(payload.shape), dtype=dtype)
    except NebulaError as exc:
        raise CodecError(f"{where}: {exc}") from exc
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, OverflowError, MemoryError) as exc:
        raise CodecError(f"{where}: codec {payload.codec!r} cannot decode these parts ({exc})") from exc
    if x.numel() != math.prod(payload.shape):
        raise CodecError(f"{where}: codec {payload.codec!r} decoded {x.numel()} elements, the header's "
                         f"shape {list(payload.shape)} has {math.prod(payload.shape)}")
    if x.dtype != dtype and not (x.dtype in WIRE_FLOATS and dtype in WIRE_FLOATS):
        raise CodecError(f"{where}: codec {payload.codec!r} decoded {dtype_names().get(x.dtype, x.dtype)}, the "
                         f"header says {payload.dtype}; a receiver converts only between float dtypes: send the "
                         "tensor's own dtype in the header (docs/protocol.md §3.2)")
    if slot is not state:
        assert state is not None and slot is not None  # a fresh slot is made above only beside a stream's state
        state.clear()
        state.update(slot)
    return x.reshape(payload.shape).to(dtype)


def _claim(state: dict[str, Any] | None, spec: str, spill_dir: str | Path | None) -> dict[str, Any] | None:
    state = claim(state, spec)
    if state is not None and spill_dir is not None and spec.startswith("delta("):
        state["spill_dir"] = str(spill_dir)  # read by `delta` when it creates its cache
    return state


def encode_meta(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode() if meta else b""


def decode_meta(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"codec meta is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise CodecError(f"codec meta must be a JSON object, got {type(meta).__name__}")
    return meta
