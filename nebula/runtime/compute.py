"""One compute interface for a stage, wherever its maths runs: in this process (nebula.runtime.executor)
or spread over the stage's data-parallel ranks (nebula.runtime.ranks.RankGroup, rank 0's side).

The runner executes its schedule's actions through it and nothing else: forward a micro-batch, backward
it (whole, or its input half and its weight half apart: nebula.runtime.split_backward), apply a step.
What a computation produces for a link goes out through the `emit` the compute was built with (the
stage's outbox), never back through the runner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch

from nebula.runtime.graph import Item, LinkConfig
from nebula.runtime.stage import Batch, Output

# (direction, link, step, micro_batch, tensors, ids): what a computation sends on one of its links
Emit = Callable[[str, LinkConfig, int, int, dict, "torch.Tensor | None"], None]
Part = Literal["all", "input", "weight"]  # a whole backward, or its input or weight half


@dataclass
class Tally:
    """What one step cost and scored at this stage."""

    losses: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


class Compute(ABC):
    @abstractmethod
    def ready_for(self, step: int) -> bool:
        """Whether step `step`'s forward may run now (the weights it needs exist)."""

    @abstractmethod
    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor], item: Item) -> None:
        """Micro-batch `item` of `batch.step`: its outputs are emitted on the out-links."""

    @abstractmethod
    def backward(self, step: int, index: int, grads: dict[str, dict[str, torch.Tensor]], part: Part) -> None:
        """Micro-batch `index`'s backward (`grads`: out-link -> the gradients its peer sent); its input
        gradients are emitted on the two-way in-link ("all" or "input"); "weight" finishes an "input"."""

    @abstractmethod
    def apply(self, step: int, ahead: Callable[[], None] | None = None) -> Tally:
        """The optimiser step of `step`; `ahead` may hand out the next step's work first (ranks)."""

    @abstractmethod
    def skip(self, step: int) -> None:
        """Move past `step` without an update: its gradients dropped, the next step at the same weights."""

    @abstractmethod
    def reset(self, step: int) -> None:
        """Restored to `step`: whatever was in flight is void."""

    @abstractmethod
    def infer_forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        """An inference batch, without gradients."""

    def elsewhere(self, index: int) -> bool:
        """Whether micro-batch `index` of a step is computed by another process (another rank)."""
        return False

    def check(self) -> None:
        """Raise if part of the computation failed (a rank)."""

    def restore(self, checkpoint: Path) -> None:
        """After this process loaded `checkpoint`: the others (ranks) load it too."""

    def broadcast_weights(self) -> None:
        """After the runtime wrote the stage's weights (an outer round of replicas): the others (ranks) take them."""

    def close(self) -> None:
        """Stop what it started."""
