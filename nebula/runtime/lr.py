"""Learning-rate schedules a stage may use (the GPT's `lr_schedule`, a split model's `optimizer.decay`): a
linear warm-up from 0, then constant, or a linear or cosine decay to 0 at the job's last step."""
from __future__ import annotations

import math
from collections.abc import Callable

DECAYS = ("constant", "linear", "cosine")


def warmup_decay(warmup_steps: int, decay: str, total_steps: int) -> Callable[[int], float]:
    """-> LambdaLR's factor of the peak lr at a step (it counts applied optimiser steps from 0); `decay` is
    one of DECAYS, reaching 0 at `total_steps` ([train].steps: a run of known length)."""
    if decay not in DECAYS:
        raise ValueError(f"unknown decay {decay!r}: one of {', '.join(DECAYS)}")
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        left = max(0.0, 1 - (step - warmup_steps) / max(1, total - warmup_steps))
        return left if decay == "linear" else 0.5 * (1 - math.cos(math.pi * left))
    return factor
