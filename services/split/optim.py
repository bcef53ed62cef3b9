"""A split stage's optimiser and learning-rate schedule, from the job file's `optimizer` table."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from nebula import workload
from nebula.errors import ConfigError
from nebula.runtime.lr import warmup_decay
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
    factor = warmup_decay(spec.warmup_steps, spec.decay, steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
