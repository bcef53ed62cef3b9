"""The `Codec` interface and the registry that names codecs in spec strings.

A codec turns one tensor into a list of parts (each part becomes one raw ZeroMQ frame) plus a small
JSON-able meta dict, and back. Decoding needs nothing but the codec (rebuilt from the spec string on
the wire), the parts and the meta: every message is self-contained, so a lost or reordered message
never desynchronises sender and receiver. Per-stream state (error-feedback residuals, the previous
step's subspace) therefore lives on the sender only, in a plain dict the caller owns (`CodecState`).

Leaf codecs are frozen dataclasses: their fields are the spec parameters, in positional order;
fields without a default are required and print positionally, the others print as `key=value`
when they differ from the default (so `int8` and `int8(block=64)` are the same codec).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, TypeVar

import torch

from nebula.errors import CodecError, ConfigError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The float dtypes a header may name. A decoded tensor is converted to the header's dtype only between
# these (round to nearest even): the lossy codecs decode to float32 whatever the sender's float dtype.
# Any other pair (float32 under a header of int64, int32 parts under int64) is refused, never
# truncated or wrapped as a cast would (docs/protocol.md §3.2).
WIRE_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# A decoded tensor never exceeds what one raw message could carry (nebula.wire Limits.max_message_bytes
# in float32): shapes come from the network, so they are bounded before anything is allocated.
MAX_DECODED_NUMEL = (1 << 31) // 4

Parts = list[torch.Tensor]
Meta = dict[str, Any]


class Codec(ABC):
    """Encode a tensor into wire parts + meta, and decode them back (float32 for lossy float codecs)."""

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = False  # bit-exact for every wire dtype: may carry token ids, masks, labels

    @property
    def spec(self) -> str:
        """Canonical spec string: `parse(codec.spec).spec == codec.spec`."""
        return format_call(self.name, spec_args(self))

    @property
    def needs_ids(self) -> bool:
        """Whether `encode` needs `ids`, the example id of each of x's rows (`delta` keeps a base per
        example). Such a codec carries activations only: gradients come back without ids."""
        return False

    @abstractmethod
    def encode(self, x: torch.Tensor, state: dict | None = None, *,
               ids: torch.Tensor | None = None) -> tuple[Parts, Meta]:
        """`state` is this stream's private dict (sender side), or None for a stateless encode; `ids`
        the (B,) int64 example ids of x's rows (its first dimension), where the caller has them."""

    @abstractmethod
    def decode(self, parts: Parts, meta: Meta) -> torch.Tensor:
        """Parts may be read-only views of received frames: never modify them in place."""

    def decode_with_state(self, parts: Parts, meta: Meta, state: dict | None,
                          shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode with the receiver's state for this stream; only `delta` keeps one (its cached rows),
        and changes it only for a message it accepts whole, the header's `shape` and `dtype` (if given)
        included."""
        return self.decode(parts, meta)

    def __str__(self) -> str:
        return self.spec


CODECS: dict[str, type[Codec]] = {}
C = TypeVar("C", bound=type[Codec])


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a codec available by `name` in spec strings; names are unique."""

    def wrap(cls: C) -> C:
        if not name.isidentifier():
            raise ConfigError(f"codec name {name!r} must be an identifier")
        if name in CODECS:
            raise ConfigError(f"codec name {name!r} is already registered by {CODECS[name].__qualname__}; "
                              "choose another name")
        cls.name = name
        CODECS[name] = cls
        return cls

    return wrap


def spec_args(codec: Codec) -> list[str]:
    """Required fields positionally, then non-default optional fields as key=value (dataclass codecs)."""
    args: list[str] = []
    for f in dataclasses.fields(codec):  # type: ignore[arg-type]  # leaf codecs are dataclasses; Codec is not
        value = getattr(codec, f.name)
        if isinstance(value, Codec) and f.type in ("Codec", Codec):
            args.insert(0, value.spec)  # the inner codec always comes first; others go by name
        elif f.default is dataclasses.MISSING:
            args.append(format_value(value))
        elif value != f.default:
            args.append(f"{f.name}={format_value(value)}")
    return args


def format_call(name: str, args: list[str]) -> str:
    return f"{name}({', '.join(args)})" if args else name


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest string that reads back to the same float
    return str(value)


# ---- helpers every codec uses to check its input and the parts/meta it is handed ----

def require_float(codec: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise CodecError(f"codec {codec!r} compresses floating-point tensors, got {x.dtype}; "
                         "send integer tensors (e.g. token ids) with codec 'none'")


def require_finite(codec: str, x: torch.Tensor) -> None:
    """One read-only pass: a sum is finite iff every element is (checked exactly when it is not)."""
    if x.numel() and not torch.isfinite(x.sum(dtype=torch.float32)):
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise CodecError(f"codec {codec!r}: tensor has {bad} NaN/Inf values; "
                             "fix the producer or send it with codec 'none'")


def check_parts(codec: str, parts: Parts, count: int) -> None:
    if len(parts) != count:
        raise CodecError(f"codec {codec!r}: expected {count} parts, got {len(parts)}")


def check_part(codec: str, part: torch.Tensor, what: str, dtypes: tuple, ndim: int | None = None) -> None:
    if part.dtype not in dtypes:
        raise CodecError(f"codec {codec!r}: {what} has dtype {part.dtype}, expected one of {dtypes}")
    if ndim is not None and part.dim() != ndim:
        raise CodecError(f"codec {codec!r}: {what} has {part.dim()} dimensions, expected {ndim}")


def meta_shape(codec: str, meta: Meta, key: str = "shape") -> tuple[int, ...]:
    """A shape from network meta: a list of non-negative ints with a bounded element count."""
    shape = meta.get(key)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 8:
        raise CodecError(f"codec {codec!r}: meta[{key!r}] must be a list of at most 8 non-negative ints, "
                         f"got {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_DECODED_NUMEL:
        raise CodecError(f"codec {codec!r}: meta[{key!r}] = {shape} has {numel} elements, over the limit "
                         f"of {MAX_DECODED_NUMEL}")
    return tuple(shape)


def check_ratio(codec: str, field: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"codec {codec!r}: {field}={value!r} must be in (0, 1], "
                          f"e.g. {codec}(0.2) keeps 20%")
