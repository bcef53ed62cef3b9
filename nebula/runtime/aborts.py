"""The coordinator's account of the steps a bad tensor aborted (nebula.runtime.integrity): which the job
skips, and how often each was run again first ([integrity] on_bad = "skip" or "retry", `retries`).

A stage that refuses a bad tensor, or withholds one of its own, asks the coordinator to abort the step; the
coordinator decides here, then resumes every stage from the last checkpoint they all hold, the steps to
skip named in RESUME, so that nothing of the aborted step is applied at any stage (docs/runtime.md,
"Integrity").
"""
from __future__ import annotations

from nebula.runtime.integrity import IntegrityConfig


class Aborts:
    def __init__(self, config: IntegrityConfig):
        self.config = config
        self.tries: dict[int, int] = {}  # step -> times it was aborted
        self.skips: set[int] = set()  # steps every stage moves past unapplied

    def decide(self, step: int) -> str:
        """Step `step` was aborted once more: -> "skipped" or "retried" (it runs again after the resume)."""
        self.tries[step] = self.tries.get(step, 0) + 1
        if self.config.on_bad == "retry" and self.tries[step] <= self.config.retries:
            return "retried"
        self.skips.add(step)
        return "skipped"

    @property
    def skip(self) -> tuple[int, ...]:
        return tuple(sorted(self.skips))
