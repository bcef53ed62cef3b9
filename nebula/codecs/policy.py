"""Which codec a tensor travels with, per link direction (paper §4.3, Table 5 and Figure 10).

Built once from the job file's table for a link: the [links.compression] table that follows its
[[links]] entry (nebula.runtime.job), e.g.

    [[links]]
    from = "src"
    to = "sink"
    tensors = ["hidden", "mask"]
    backward = true
    [links.compression]
    forward = "fp16(svd(0.6))"   # activations, from -> to
    backward = "int8"            # gradients, back on a two-way link
    start_step = 2000            # uncompressed before this step (Figure 10)
    min_numel = 4096             # smaller tensors go uncompressed
    # forward = "auto" (or the link's `compression = "auto"`): picked while training (nebula.codecs.auto)
    [links.compression.overrides]
    "labels" = "none"                                   # both directions
    "*.attention_mask" = { forward = "none" }           # fnmatch pattern, one direction

Precedence for a tensor: before start_step -> none; else the first override whose pattern matches
its name (exact names before patterns); else none below min_numel or for non-float tensors; else
the direction's codec.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from nebula.codecs.auto import AUTO, AutoSettings
from nebula.codecs.base import FLOAT_DTYPES, Codec
from nebula.codecs.none import NoCodec
from nebula.codecs.spec import parse
from nebula.errors import ConfigError

DIRECTIONS = ("forward", "backward")
NONE = NoCodec()


@dataclass(frozen=True, kw_only=True)
class Override:
    pattern: str
    forward: Codec | None = None  # None: the policy's codec for that direction
    backward: Codec | None = None


@dataclass(frozen=True, kw_only=True)
class CompressionPolicy:
    forward: Codec = NONE
    backward: Codec = NONE
    start_step: int = 0
    min_numel: int = 0
    overrides: tuple[Override, ...] = field(default=())
    auto: AutoSettings = field(default_factory=AutoSettings)  # the ladders where a direction is "auto"

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], where: str = "compression") -> "CompressionPolicy":
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
        known = {"forward", "backward", "start_step", "min_numel", "overrides", "auto"}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(forward=_codec(f"{where}.forward", table.get("forward", "none"), may_be_auto=True),
                   backward=_gradients(f"{where}.backward", _codec(f"{where}.backward", table.get("backward", "none"),
                                                                   may_be_auto=True)),
                   start_step=_count(f"{where}.start_step", table.get("start_step", 0),
                                     "set 0 to compress from the first step"),
                   min_numel=_count(f"{where}.min_numel", table.get("min_numel", 0),
                                    "set 0 to compress tensors of every size"),
                   overrides=_overrides(f"{where}.overrides", table.get("overrides", {})),
                   auto=AutoSettings.from_dict(table.get("auto", {}), f"{where}.auto"))

    def codec_for(self, direction: str, name: str, numel: int, step: int,
                  dtype: torch.dtype | None = None) -> Codec:
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction must be 'forward' or 'backward', got {direction!r}")
        if step < self.start_step:
            return NONE
        override = self._override(name)
        chosen = getattr(override, direction) if override is not None else None
        codec = chosen if chosen is not None else getattr(self, direction)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return codec if codec.exact else NONE  # ids and masks: only an exact codec, else as they are
        if chosen is None and numel < self.min_numel:
            return NONE
        return codec

    def to_dict(self) -> dict[str, Any]:
        overrides = {o.pattern: {d: getattr(o, d).spec for d in DIRECTIONS if getattr(o, d) is not None}
                     for o in self.overrides}
        return {"forward": self.forward.spec, "backward": self.backward.spec, "start_step": self.start_step,
                "min_numel": self.min_numel, "overrides": overrides, "auto": self.auto.to_dict()}

    def _override(self, name: str) -> Override | None:
        exact = next((o for o in self.overrides if o.pattern == name), None)
        return exact or next((o for o in self.overrides if fnmatch.fnmatchcase(name, o.pattern)), None)


def _codec(where: str, spec: Any, may_be_auto: bool = False) -> Codec:
    if not isinstance(spec, str):
        raise ConfigError(f"{where}: expected a codec spec string such as \"fp16(svd(0.6))\", got {spec!r}")
    if spec.strip() == "auto":
        if not may_be_auto:
            raise ConfigError(f"{where}: \"auto\" applies to a whole direction, not to single tensors; "
                              "name a codec here")
        return AUTO
    try:
        return parse(spec)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _gradients(where: str, codec: Codec) -> Codec:
    """A backward codec: not `delta`, whose per-example bases need the example ids only activations carry."""
    from nebula.codecs.delta import Delta
    if isinstance(codec, Delta):
        raise ConfigError(f"{where} = {codec.spec!r}: delta compresses activations per example and gradients "
                          "carry no example ids; use it forward, and e.g. \"ef(int8)\" backward")
    return codec


def _count(where: str, value: Any, hint: str) -> int:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{where}: expected a non-negative integer, got {value!r} ({hint})")
    return value


def _overrides(where: str, table: Any) -> tuple[Override, ...]:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table of name = codec spec, got {type(table).__name__}")
    overrides = []
    for pattern, value in table.items():
        at = f"{where}.{pattern!r}"
        if isinstance(value, str):  # both directions, so not `delta`
            codec = _gradients(at, _codec(at, value))
            overrides.append(Override(pattern=pattern, forward=codec, backward=codec))
            continue
        if not isinstance(value, Mapping) or not value or set(value) - set(DIRECTIONS):
            raise ConfigError(f"{at}: expected a codec spec or a table with forward and/or backward, "
                              f"e.g. {{ forward = \"none\" }}, got {value!r}")
        codecs = {d: _codec(f"{at}.{d}", s) for d, s in value.items()}
        if "backward" in codecs:
            _gradients(f"{at}.backward", codecs["backward"])
        overrides.append(Override(pattern=pattern, **codecs))
    return tuple(overrides)
