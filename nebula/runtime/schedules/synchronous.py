"""`synchronous` (the default): step t+1 starts once step t is applied, so the result equals
one-process training up to codec error. A forward-only link runs in lock step (credit 1): the sender
opens step t once its receiver has applied step t - 1.

Each step pays the pipeline's fill and drain (docs/bench-wan.md: 1.12-1.53x above max(compute, wire)
with 4 micro-batches); `one-step-stale` hides them.
"""
from __future__ import annotations

from nebula.codecs.auto import SYNC_HEADROOM
from nebula.runtime.schedules.base import Schedule, register_schedule


@register_schedule("synchronous")
class Synchronous(Schedule):
    default_headroom = SYNC_HEADROOM  # the fill and drain's wire is exposed: ~0.4 of compute hides

    @property
    def credit(self) -> int:
        return 1
