"""A job file's [links.compression] table -> a CompressionPolicy (nebula.codecs.policy), checked by
the config engine (nebula.config.build) and, for codec specs, by their parser. The table that
follows a [[links]] entry:

    [links.compression]
    forward = "fp16(svd(0.6))"   # activations, from -> to; or "auto" (nebula.codecs.auto)
    backward = "int8"            # gradients, back on a two-way link; or "auto"
    start_step = 2000            # uncompressed before this step (Figure 10): a phase of its own
    min_numel = 4096             # smaller tensors go uncompressed
    [links.compression.overrides]
    "labels" = "none"                                   # both directions
    "*.attention_mask" = { forward = "none" }           # fnmatch pattern, one direction
    [links.compression.auto]                            # the ladders, where a direction is "auto"
    forward = ["none", "fp16", "int8"]
    headroom = 0.4
    every = 4

`compression = "auto"` on the link is short for both directions "auto". Or a list of phases, each a
table of the keys above that lasts `steps` training steps (the keys outside `phases`: defaults for
every phase; the last phase stays in force after it ends):

    [links.compression]
    backward = "int8"
    phases = [{steps = 4, forward = "none", backward = "none"},
              {steps = 4, forward = "fp16(svd(0.6))"}]      # steps 5-8; backward int8 from the default
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from nebula.codecs.auto import EVERY, LADDER, Auto
from nebula.codecs.base import Codec
from nebula.codecs.delta import Delta
from nebula.codecs.policy import CompressionPolicy, Phase, Setting
from nebula.codecs.spec import parse
from nebula.config import build, check, limits
from nebula.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class AutoKeys:
    """[links.compression.auto]: a ladder per direction, least lossy first; headroom and every for both."""

    forward: tuple[str, ...] = LADDER
    backward: tuple[str, ...] = LADDER
    headroom: float | None = field(default=None, metadata=limits(
        above=0, at_most=4, hint="the share of the sender's compute the wire may take; leave it out for "
                                 "the schedule's default"))
    every: int = field(default=EVERY, metadata=limits(at_least=1, hint="steps between decisions"))


@dataclass(frozen=True, kw_only=True)
class OverrideKeys:
    forward: str | None = None
    backward: str | None = None


@dataclass(frozen=True, kw_only=True)
class PolicyKeys:
    forward: str = "none"
    backward: str = "none"
    start_step: int = field(default=0, metadata=limits(at_least=0, hint="set 0 to compress from the first step"))
    min_numel: int = field(default=0, metadata=limits(at_least=0, hint="set 0 to compress tensors of every size"))
    overrides: dict[str, Any] = field(default_factory=dict)  # name -> a spec (both directions) or OverrideKeys
    auto: AutoKeys = field(default_factory=AutoKeys)


@dataclass(frozen=True, kw_only=True)
class PhaseKeys(PolicyKeys):
    steps: int = field(metadata=limits(at_least=1, hint="how many training steps this phase lasts"))


def read_policy(table: Mapping[str, Any] | str, where: str = "compression") -> CompressionPolicy:
    """The policy a link's [links.compression] table (or "auto") says; `where` names it in errors."""
    if table == "auto":
        table = {"forward": "auto", "backward": "auto"}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table or \"auto\", got {table!r}")
    defaults = {k: v for k, v in table.items() if k != "phases"}
    alone = _phases([(build(PolicyKeys, defaults, where), where)])  # the defaults' mistakes, at their own keys
    if "phases" not in table:
        return CompressionPolicy(alone)
    entries = check(list[dict], table["phases"], f"{where}.phases")
    if not entries:
        raise ConfigError(f"{where}.phases: expected a non-empty list of tables such as "
                          f"[{{steps = 100, forward = \"fp16\", backward = \"int8\"}}], got []")
    return CompressionPolicy(_phases([(build(PhaseKeys, {**defaults, **entry}, f"{where}.phases[{i}]"),
                                       f"{where}.phases[{i}]") for i, entry in enumerate(entries)]))


def _phases(entries: list[tuple[PolicyKeys, str]]) -> tuple[Phase, ...]:
    """Consecutive phases from step 1, the last open-ended. A `start_step` past a phase's first step
    makes the phase's steps before it a phase of their own, uncompressed."""
    phases, first = [], 1
    for i, (keys, where) in enumerate(entries):
        settings = {d: _setting(keys, d, where) for d in ("forward", "backward")}
        steps = keys.steps if isinstance(keys, PhaseKeys) and i < len(entries) - 1 else None
        held = max(0, keys.start_step - first)  # steps before start_step
        if steps is not None:
            held = min(held, steps)
        if held:
            phases.append(Phase(first_step=first, steps=held))
            first += held
            if steps is not None:
                steps -= held
                if not steps:
                    continue
        phases.append(Phase(first_step=first, steps=steps, **settings))
        first += steps or 0
    return tuple(phases)


def _setting(keys: PolicyKeys, direction: str, where: str) -> Setting:
    at, spec = f"{where}.{direction}", getattr(keys, direction)
    auto = _auto(keys.auto, direction, f"{where}.auto")  # checked where unused too: a mistake all the same
    codec = auto if spec.strip() == "auto" else _codec(at, spec)
    if direction == "backward":
        _carries_gradients(at, codec)
    return Setting(codec=codec, overrides=_overrides(keys.overrides, direction, f"{where}.overrides"),
                   min_numel=keys.min_numel)


def _overrides(table: dict[str, Any], direction: str, where: str) -> tuple[tuple[str, Codec], ...]:
    """This direction's overrides, in the file's order: a spec names both directions, a table one or both."""
    overrides = []
    for pattern, value in table.items():
        at = f"{where}.{pattern!r}"
        if isinstance(value, str):  # both directions, so gradients too
            codec = _codec(at, value)
            _carries_gradients(at, codec)
            overrides.append((pattern, codec))
            continue
        keys = build(OverrideKeys, value, at)
        if keys.forward is None and keys.backward is None:
            raise ConfigError(f"{at}: expected a codec spec or a table with forward and/or backward, "
                              f"e.g. {{ forward = \"none\" }}, got {value!r}")
        spec = getattr(keys, direction)
        if spec is not None:
            codec = _codec(f"{at}.{direction}", spec)
            if direction == "backward":
                _carries_gradients(f"{at}.backward", codec)
            overrides.append((pattern, codec))
    return tuple(overrides)


def _auto(keys: AutoKeys, direction: str, where: str) -> Auto:
    at, specs = f"{where}.{direction}", getattr(keys, direction)
    if not specs:
        raise ConfigError(f"{at}: expected a non-empty list of codec specs, least lossy first, "
                          f"e.g. [\"none\", \"fp16\", \"int8\"], got []")
    ladder = tuple(_codec(f"{at}[{i}]", spec) for i, spec in enumerate(specs))
    for i, codec in enumerate(ladder):
        if isinstance(codec, Delta):
            raise ConfigError(f"{at}[{i}] = {specs[i]!r}: `auto` does not switch `delta` streams (their caches "
                              "would be dropped at every switch); name the delta codec without `auto`")
    return Auto(ladder=ladder, headroom=keys.headroom, every=keys.every)


def _codec(where: str, spec: str) -> Codec:
    if spec.strip() == "auto":
        raise ConfigError(f"{where}: \"auto\" applies to a whole direction, not to single tensors or a "
                          "ladder's rungs; name a codec here")
    try:
        return parse(spec)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _carries_gradients(where: str, codec: Codec | Auto) -> None:
    """Gradients come back without example ids: refuse a codec that needs them (delta). (A ladder
    holds none: _auto.)"""
    if isinstance(codec, Codec) and codec.needs_ids:
        raise ConfigError(f"{where} = {codec.spec!r}: it compresses activations per example and gradients "
                          "carry no example ids; use it forward, and e.g. \"ef(int8)\" backward")
