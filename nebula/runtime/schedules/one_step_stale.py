"""`one-step-stale` (PipeDream-2BW): a stage that waits for gradients forwards step t+1 before
applying step t, so neither the link nor the receiver waits for an update.

Such a stage runs step t's forward *and* backward at W_{t-2}, the weights after step t-2, kept as a
stash (`torch.func.functional_call` in nebula.runtime.executor), and applies the resulting gradient
to the current weights; sinks (and every stage without a two-way out-link) stay exact. The copy of
W_{t-2} is taken before the update that overwrites it, and the stash's leaves collect the step's
gradients. Nothing runs ahead across a checkpoint: right after checkpoint step t-1 (the grid's, or a
restore off it, e.g. a hot start from `one-site --until N`), step t runs at W_{t-1}, so the saved state
is exactly what a resumed run starts from and a resumed job equals an uninterrupted one.
Forward-only links get credit 2.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from nebula.codecs.auto import STALE_HEADROOM
from nebula.errors import StageError
from nebula.runtime.actions import Action
from nebula.runtime.schedules.base import ExactWeights, Params, Schedule, register_schedule
from nebula.runtime.schedules.synchronous import greedy
from nebula.runtime.train import TrainConfig

if TYPE_CHECKING:
    from nebula.runtime.board import Board


class WeightStash(ExactWeights):
    """W_{t-2} for each step t that runs stale: taken before the update that overwrites it."""

    def __init__(self, saves_after: Callable[[int], bool]):
        super().__init__()
        self.saves_after = saves_after  # TrainConfig.saves_after: nothing runs ahead across a checkpoint
        self.stash: dict[int, Params] = {}
        self.restored = 0  # the step last restored: like a checkpoint step, nothing was stashed across it

    def stale(self, step: int) -> bool:
        return step > 1 and not self.saves_after(step - 1) and step - 1 != self.restored

    def ready_for(self, step: int) -> bool:
        return step == self.applied + 1 or (step == self.applied + 2 and self.stale(step))

    def for_step(self, step: int, params: Mapping[str, torch.Tensor]) -> Params | None:
        if not self.stale(step):
            return super().for_step(step, params)
        if step not in self.stash:
            if step != self.applied + 2:
                raise StageError(f"no stashed weights for step {step} (applied {self.applied})")
            self.stash[step] = _snapshot(params)
        return self.stash[step]

    def before_update(self, step: int, params: Mapping[str, torch.Tensor]) -> None:
        """Keep W_{step-1} for step + 1, then put the gradients computed at the stash on the live weights."""
        if self.stale(step + 1) and step + 1 not in self.stash:
            self.stash[step + 1] = _snapshot(params)
        if step in self.stash:
            stash = self.stash.pop(step)
            for key, param in params.items():
                param.grad = stash[key].grad

    def reset(self, step: int) -> None:
        super().reset(step)
        self.stash.clear()
        self.restored = step


def _snapshot(params: Mapping[str, torch.Tensor]) -> Params:
    return {k: p.detach().clone().requires_grad_() for k, p in params.items()}


@register_schedule("one-step-stale")
class OneStepStale(Schedule):
    default_headroom = STALE_HEADROOM  # the wire overlaps the next step's compute whole
    exact_weights = False  # a stage that waits for gradients forwards step t+1 before applying step t
    drains = False  # step t+1's forwards fill step t's drain

    def order(self, board: Board) -> Action | None:
        return greedy(board)  # the stash, not the order, lets step t+1 run before t is applied

    @property
    def credit(self) -> int:
        return 2

    def opens(self, applied: int, waits: bool, train: TrainConfig) -> tuple[int, ...]:
        t = applied + 1
        # saves_after(t) is also true at the last step: nothing runs past the end or across a checkpoint
        return (t, t + 1) if waits and not train.saves_after(t) else (t,)

    def weights(self, waits: bool, train: TrainConfig) -> ExactWeights:
        return WeightStash(train.saves_after) if waits else ExactWeights()
