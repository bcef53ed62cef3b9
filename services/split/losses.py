"""The loss of a split job, by name or by reference, and what an evaluation scores per example.

    next-token      cross entropy of logits (B, T, V) against the next tokens (B, T); -100 is skipped
    classification  cross entropy of logits (B, C) against classes (B,)
    mse             mean squared error of outputs against targets of the same shape
    package.module:function   function(output, target) -> a scalar tensor
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from nebula import workload
from nebula.errors import ConfigError, DataError

IGNORE = -100
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def next_token(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE)


def classification(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target.long())


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float().view_as(output))


NAMED: dict[str, Loss] = {"next-token": next_token, "classification": classification, "mse": mse}


def loss_function(name: str) -> Loss:
    if name in NAMED:
        return NAMED[name]
    if ":" not in name:
        raise ConfigError(f"loss {name!r}: one of {', '.join(NAMED)}, or \"package.module:function\"")
    return workload.load(name, "loss")


def checked(loss: Loss, name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`loss(output, target)`, with a DataError naming the loss where the two do not fit."""
    try:
        value = loss(output, target)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise DataError(f"loss {name!r} of output {tuple(output.shape)} and target {tuple(target.shape)} "
                        f"{target.dtype}: {exc}") from exc
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(f"loss {name!r} returned {type(value).__name__}, not a scalar tensor")
    return value


def per_example(name: str, loss: Loss, output: torch.Tensor, target: torch.Tensor) -> list[list[float]]:
    """[summed loss, count, correct] per example: count is its scored tokens (next-token) or 1; correct
    counts right predictions (next tokens, classes; 0 for the others)."""
    rows = []
    for i in range(output.shape[0]):
        out, tgt = output[i:i + 1], target[i:i + 1]
        if name == "next-token":
            keep = tgt != IGNORE
            n = int(keep.sum())
            right = float((out.argmax(-1) == tgt)[keep].sum())
            rows.append([float(next_token(out, tgt)) * n, n, right])
        elif name == "classification":
            rows.append([float(classification(out, tgt)), 1, float(out.argmax(-1).item() == int(tgt))])
        else:
            rows.append([float(checked(loss, name, out, tgt)), 1, 0.0])
    return rows


def summary(name: str, split: str, rows: list[list[float]]) -> dict:
    """The mean loss over what was scored, and the accuracy where it means something."""
    total, count, right = (sum(r[k] for r in rows) for k in range(3))
    scores = {"split": split, "n": len(rows), "loss": total / max(1, count)}
    if name == "next-token":
        scores.update(tokens=count, ppl=float(torch.tensor(scores["loss"]).clamp(max=50).exp()),
                      accuracy=right / max(1, count))
    elif name == "classification":
        scores["accuracy"] = right / max(1, count)
    return scores
