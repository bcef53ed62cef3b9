"""A split stage's optimiser and learning-rate schedule, from the job file's `optimizer` table."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from nebula import workload
from nebula.errors import ConfigError
from services.split.options import OptimizerSpec


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter], steps: int) -> tuple[Any, Any]:
    """(optimizer, LambdaLR scheduler): warm-up from 0 over warmup_steps, then constant, or linear / cosine
    decay to 0 at `steps` ([train].steps)."""
    cls = getattr(torch.optim, spec.name, None) if ":" not in spec.name else workload.load(spec.name, "optimizer")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                       and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer")
        raise ConfigError(f"optimizer.name {spec.name!r}: a torch.optim class ({', '.join(names)}) or "
                          "\"package.module:Class\"")
    try:
        optimizer = cls(list(params), lr=spec.lr, **spec.args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"optimizer {spec.name}: {exc} (optimizer.args are its keyword arguments)") from exc
    warmup, total = spec.warmup_steps, max(1, steps)

    def factor(step: int) -> float:  # LambdaLR's step counts applied optimiser steps from 0
        if step < warmup:
            return (step + 1) / warmup
        if spec.decay == "constant":
            return 1.0
        left = max(0.0, 1 - (step - warmup) / max(1, total - warmup))
        return left if spec.decay == "linear" else 0.5 * (1 - math.cos(math.pi * left))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
