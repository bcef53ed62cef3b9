"""Which codec a tensor travels with: a link's compression policy (paper §4.3, Table 5 and Figure 10).

A policy is a list of phases of training steps (steps count from 1), each following the last; the
last phase is open-ended (evaluation after training uses the last step's codec). In a phase each
direction of the link, "forward" (activations, from -> to) and "backward" (the gradients coming back
on a two-way link), has a `Setting`: a codec, or `auto` (nebula.codecs.auto: a ladder whose rung the
sender picks while training, resolved by the link before anything is encoded), with per-tensor
overrides and a size below which tensors go uncompressed.

Every spelling of a job file's [links.compression] table (one table, `start_step`, `phases`, `auto`)
loads into this model: nebula.codecs.policy_table.

Both sites read the same job file and every message names its codec, so a phase change needs no
coordination: each sender picks the codec by the step it is sending for.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from nebula.codecs.auto import Auto
from nebula.codecs.base import FLOAT_DTYPES, Codec
from nebula.codecs.none import NoCodec
from nebula.errors import ConfigError

DIRECTIONS = ("forward", "backward")
NONE = NoCodec()


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What one direction of a link sends during one phase."""

    codec: Codec | Auto = NONE
    overrides: tuple[tuple[str, Codec], ...] = ()  # (tensor name or fnmatch pattern, its codec), as written
    min_numel: int = 0  # smaller tensors go uncompressed, unless an override names them

    def codec_for(self, name: str, numel: int, dtype: torch.dtype | None = None) -> Codec | Auto:
        """The override naming the tensor (exact names before patterns), else none below min_numel,
        else the setting's codec; a non-float tensor (ids, masks) only with an exact codec, else as it is."""
        chosen = self._override(name)
        codec = self.codec if chosen is None else chosen
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return codec if isinstance(codec, Codec) and codec.exact else NONE
        if chosen is None and numel < self.min_numel:
            return NONE
        return codec

    def _override(self, name: str) -> Codec | None:
        exact = next((codec for pattern, codec in self.overrides if pattern == name), None)
        if exact is not None:
            return exact
        return next((codec for pattern, codec in self.overrides if fnmatch.fnmatchcase(name, pattern)), None)


UNCOMPRESSED = Setting()


@dataclass(frozen=True, kw_only=True)
class Phase:
    first_step: int  # inclusive
    steps: int | None  # None: open-ended, the last phase
    forward: Setting = UNCOMPRESSED
    backward: Setting = UNCOMPRESSED

    def setting(self, direction: str) -> Setting:
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward


@dataclass(frozen=True)
class CompressionPolicy:
    phases: tuple[Phase, ...] = (Phase(first_step=1, steps=None),)  # by default everything uncompressed

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("a compression policy needs at least one phase")
        first = 1
        for i, phase in enumerate(self.phases):
            last = i == len(self.phases) - 1
            if phase.first_step != first or (phase.steps is None) != last or (phase.steps or 1) < 1:
                raise ConfigError(f"compression phases must follow each other from step 1, each of at least "
                                  f"one step and only the last open-ended; phase {i + 1} of {len(self.phases)} "
                                  f"starts at step {phase.first_step} and lasts {phase.steps}")
            first += phase.steps or 0

    @classmethod
    def fixed(cls, forward: Setting = UNCOMPRESSED, backward: Setting = UNCOMPRESSED) -> CompressionPolicy:
        """One setting per direction for the whole run."""
        return cls((Phase(first_step=1, steps=None, forward=forward, backward=backward),))

    def phase_at(self, step: int) -> Phase:
        """The phase in force at `step`: the last one that has started (the first before step 1)."""
        return next((p for p in reversed(self.phases) if p.first_step <= step), self.phases[0])

    def codec_for(self, direction: str, name: str, numel: int, step: int,
                  dtype: torch.dtype | None = None) -> Codec | Auto:
        """The codec for tensor `name` sent in `direction` for training step `step`; an `Auto` is the
        link's to resolve to a rung (nebula.runtime.compression)."""
        return self.phase_at(step).setting(direction).codec_for(name, numel, dtype)
