"""Fault injection for integrity (issue 55), hivemind-style: the example workload's stages, each misbehaving
in one way: a source whose activation is replaced by NaN or Inf on chosen training steps (a faulty or
hostile peer), a sink with a bug in its forward, a source whose tensor is wider than its port says."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nebula.runtime.job_digest import SITE_LOCAL
from nebula.runtime.outbox import Outbox
from nebula.runtime.stage import Output
from tests.support.runtime import PacedOptions, PacedSink, PacedSource


@dataclass(frozen=True, kw_only=True)
class PoisonOptions(PacedOptions):
    # a fault of this site's copy of the stage, not the job's definition (the other site runs the same job)
    poison_steps: tuple[int, ...] = field(default=(), metadata=SITE_LOCAL)  # training steps whose activation goes bad
    poison: str = field(default="nan", metadata=SITE_LOCAL)  # what replaces it: "nan", "inf" or "-inf"
    # a hostile peer: its process sends what it computes unchecked (Outbox.check_outgoing off), so its bad
    # tensors reach the receiver, which refuses them
    hostile: bool = field(default=False, metadata=SITE_LOCAL)
    poison_attempts: int = field(default=0, metadata=SITE_LOCAL)  # a step goes bad on its first N runs (0: all)


class PoisonedSource(PacedSource):
    Options = PoisonOptions

    def __init__(self, context, options: PoisonOptions):
        super().__init__(context, options)
        if options.hostile:
            Outbox.check_outgoing = False  # this process only: it is the hostile peer's
        self.attempts: dict[int, int] = {}  # step -> times its first micro-batch was computed

    def forward(self, batch, inputs) -> Output:
        out = super().forward(batch, inputs)
        if batch.training and batch.micro_batch == 0:
            self.attempts[batch.step] = self.attempts.get(batch.step, 0) + 1
        attempts = self.options.poison_attempts
        if batch.training and batch.step in self.options.poison_steps \
                and (not attempts or self.attempts[batch.step] <= attempts):
            bad = float(self.options.poison)
            out.tensors["hidden"] = out.tensors["hidden"] * 0 + bad  # (B, width), every value bad, graph kept
        return out


class BuggySink(PacedSink):
    """The example sink with a bug in its own code: its forward raises at step 2 (as a torch error would)."""

    def forward(self, batch, inputs) -> Output:
        if batch.training and batch.step == 2:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x20 and 16x1)")  # torch's words
        return super().forward(batch, inputs)


class WideSource(PacedSource):
    """A source whose `hidden` is 4 columns wider than the width its port declares (another version of the
    stage's code at one site): its receiver refuses the first message."""

    def forward(self, batch, inputs) -> Output:
        out = super().forward(batch, inputs)
        hidden = out.tensors["hidden"]  # (B, width)
        out.tensors["hidden"] = torch.cat([hidden, hidden[:, :4]], dim=1)  # (B, width + 4)
        return out


class TorchBusySource(PacedSource):
    """The paced source with ~a second of torch work in each forward: a stage that is inside a torch op
    when its peer fails (tests/unit/test_onesite_process.py)."""

    def forward(self, batch, inputs) -> Output:
        a = torch.randn(400, 400)
        for _ in range(300):
            a = torch.tanh(a @ a)
        return super().forward(batch, inputs)
