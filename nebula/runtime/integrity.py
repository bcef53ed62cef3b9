"""Integrity of what a stage trains on: every received tensor finite, its norm in line with its link's.

A tensor that decodes cleanly can still poison a model (issue 55: a source's NaN activation on 3 steps of
60 made every weight of both stages NaN, and the job ended `done`). So each floating tensor a link
receives is inspected once, after decoding and before use, in one read pass: its norm (float32 sum of
squares). A finite norm proves every value finite; only a non-finite one costs a second pass, to count
the NaN/Inf values (or to find that the squares overflowed: no bad value, an outlier norm).

Per link, direction and tensor, the norms of the last `window` accepted tensors give a running median
(robust: a few bad ones do not move it). A norm `warn_factor` times above or below it is warned about; one
`refuse_factor` times above it is refused like a non-finite one. Refusals and warnings are metrics events
and records of the stage's audit log (`<workdir>/audit.jsonl`, hash-chained, `nebula audit verify`),
the first few per link and interval in full and the rest counted (a peer can send them at will). Every
`report_every` steps the statistics are a metrics event of their own (`integrity`).

A stage also stops at a non-finite loss (before anything is saved: checkpoint.py refuses a non-finite
weight besides), and `Link.receive` raises the refusals here, which the runner reports to the sender.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nebula.config import limits
from nebula.errors import ConfigError, DataError, StageError
from nebula.runtime.metrics import MetricsLog
from nebula.security.audit import AuditLog


@dataclass(frozen=True, kw_only=True)
class IntegrityConfig:
    """The job's [integrity] table (docs/runtime.md, "Integrity")."""

    window: int = field(default=64, metadata=limits(at_least=4))  # norms a link direction's median is of
    warmup: int = field(default=8, metadata=limits(at_least=1))  # norms seen before any is judged
    warn_factor: float = field(default=10.0, metadata=limits(above=1))  # this far from the median: a warning
    refuse_factor: float = field(default=0.0, metadata=limits(at_least=0, hint="0 = never"))  # above: refused
    # What a bad tensor does to its step: "skip" (applied at no stage), "retry" (run again `retries` times,
    # then skipped) or "stop" (both sites stop with the reason, exit 3). nebula.runtime.coordinator aborts it.
    on_bad: str = "skip"
    retries: int = field(default=2, metadata=limits(at_least=0))

    def __post_init__(self) -> None:
        if self.on_bad not in ON_BAD:
            raise ConfigError(f"[integrity] on_bad = {self.on_bad!r}: use one of {', '.join(map(repr, ON_BAD))}")
        if self.refuse_factor and self.refuse_factor < self.warn_factor:
            raise ConfigError(f"[integrity] refuse_factor {self.refuse_factor} is below warn_factor "
                              f"{self.warn_factor}: a tensor would be refused without a warning first")


ON_BAD = ("skip", "retry", "stop")


class BadTensor(DataError):
    """A received tensor refused: non-finite values, or a norm past [integrity] refuse_factor."""

    def __init__(self, message: str, reason: str, step: int = 0):
        super().__init__(message)
        self.reason = reason  # "non-finite" or "outlier"
        self.step = step  # the training step it belongs to


def inspect_norm(tensor: torch.Tensor) -> tuple[float, int]:
    """(norm, non-finite values) in one pass when the tensor is finite, two when it is not."""
    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float32))
    if math.isfinite(norm):
        return norm, 0
    return norm, int((~torch.isfinite(tensor)).sum())  # 0: every value finite, the squares overflowed


class NormStats:
    """The running statistics of one link direction's tensor: the norms of the last `window` accepted."""

    def __init__(self, window: int, warmup: int):
        self.norms: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.seen = self.warned = self.refused = 0
        self.last = 0.0

    def ratio(self, norm: float) -> float | None:
        """`norm` over the running median, once `warmup` norms were seen (None before)."""
        if len(self.norms) < self.warmup:
            return None
        median = statistics.median(self.norms)
        return norm / median if median > 0 else (1.0 if norm == 0 else math.inf)

    def accept(self, norm: float) -> None:
        self.norms.append(norm)
        self.seen += 1
        self.last = norm

    def summary(self) -> dict[str, Any]:
        median = statistics.median(self.norms) if self.norms else None
        return {"median": median, "last": self.last, "seen": self.seen, "warned": self.warned,
                "refused": self.refused}


class Integrity:
    """A stage's checks of what it receives and of its loss, with their statistics and records."""

    def __init__(self, config: IntegrityConfig, metrics: MetricsLog | None = None, audit: AuditLog | None = None,
                 report_every: int = 10):
        self.config, self.metrics, self.audit, self.report_every = config, metrics, audit, report_every
        self.stats: dict[str, NormStats] = {}  # "link:direction/tensor" -> its statistics
        self._reported = 0  # the last step whose statistics were reported

    @classmethod
    def for_stage(cls, config: IntegrityConfig, workdir: Path, metrics: MetricsLog) -> Integrity:
        return cls(config, metrics, AuditLog(Path(workdir) / "audit.jsonl"), metrics.log_every)

    def inspect(self, tensor: torch.Tensor, *, link: str, direction: str, name: str, src: str, step: int,
                micro_batch: int) -> None:
        """Check one received floating tensor; BadTensor (recorded) if it must not be used."""
        key = f"{link}:{direction}/{name}"
        stats = self.stats.get(key) or self.stats.setdefault(key, NormStats(self.config.window, self.config.warmup))
        norm, bad = inspect_norm(tensor)
        ratio = None if bad else stats.ratio(norm)
        at = _tensor_key(link, direction, src, name)
        if bad or (ratio is not None and self.config.refuse_factor and ratio > self.config.refuse_factor):
            stats.refused += 1
            reason = "non-finite" if bad else "outlier"
            self._event("integrity.refused", at, _refusal(step, micro_batch, reason, bad, norm, ratio))
            if self.audit is not None:  # a peer can send bad tensors at will: a few in full, the rest counted
                self.audit.repeated("integrity.refused", _tensor_key(link, direction, src, name),
                                    _refusal(step, micro_batch, reason, bad, norm, ratio), reason=reason)
            where = (f"{src} sent step {step} micro-batch {micro_batch} on link {link}: {name!r} "
                     f"({'gradient' if direction == 'backward' else 'activation'})")
            if bad:
                raise BadTensor(f"{where} has {bad} NaN/Inf values of {tensor.numel()}: refused, nothing of it is "
                                "used; look for the cause at the sender (its inputs, its learning rate)",
                                "non-finite", step)
            raise BadTensor(f"{where} has norm {norm:.4g}, {ratio:.3g} times its link's running median (past "
                            f"[integrity] refuse_factor {self.config.refuse_factor:g}): refused", "outlier", step)
        if ratio is not None and (ratio > self.config.warn_factor or ratio < 1 / self.config.warn_factor):
            stats.warned += 1
            self._event("integrity.outlier", at, _warning(step, micro_batch, norm, ratio))
            if self.audit is not None:
                self.audit.repeated("integrity.outlier", _tensor_key(link, direction, src, name),
                                    _warning(step, micro_batch, norm, ratio), reason="outlier")
        stats.accept(norm)
        self._maybe_report(step)

    def outgoing(self, tensor: torch.Tensor, *, link: str, direction: str, name: str, step: int,
                 micro_batch: int) -> BadTensor | None:
        """A tensor this stage is about to send: a BadTensor (recorded) when it holds NaN/Inf, which is then
        withheld: never encoded (no codec's state sees it), never sent; its step is aborted instead."""
        _, bad = inspect_norm(tensor)
        if not bad:
            return None
        self._event("integrity.withheld", _withheld_key(link, direction, name), _withholding(step, micro_batch, bad))
        if self.audit is not None:
            self.audit.repeated("integrity.withheld", _withheld_key(link, direction, name),
                                _withholding(step, micro_batch, bad), reason="non-finite")
        what = "gradient" if direction == "backward" else "activation"
        return BadTensor(f"this stage's own {what} {name!r} of step {step} micro-batch {micro_batch} on link {link} "
                         f"has {bad} NaN/Inf values of {tensor.numel()}: withheld, not sent", "non-finite", step)

    def check_loss(self, loss: float | None, step: int) -> None:
        """A non-finite loss stops the stage (StageError) before the step's checkpoint is written."""
        if loss is None or math.isfinite(loss):
            return
        if self.audit is not None:
            self.audit.append("integrity.loss", step=step, loss=str(loss))
        raise StageError(f"the loss of step {step} is {loss}: the stage stops before saving anything (its last "
                         "checkpoint holds finite weights); look for the cause in its inputs and learning rate")

    def summary(self) -> dict[str, dict[str, Any]]:
        return {key: stats.summary() for key, stats in self.stats.items()}

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()

    def _event(self, event: str, at: dict[str, Any], fields: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.event(event, **at, **fields)

    def _maybe_report(self, step: int) -> None:
        if self.metrics is not None and step >= self._reported + self.report_every:
            self._reported = step
            self.metrics.event("integrity", echo=False, step=step, norms=self.summary())


def _tensor_key(link: str, direction: str, src: str, tensor: str) -> dict[str, str]:
    """What the audit log counts a received tensor's refusals and warnings under (nebula.security.audit)."""
    return {"link": link, "direction": direction, "src": src, "tensor": tensor}


def _withheld_key(link: str, direction: str, tensor: str) -> dict[str, str]:
    """... and a tensor of the stage's own that it withheld."""
    return {"link": link, "direction": direction, "tensor": tensor}


def _refusal(step: int, micro_batch: int, reason: str, values: int, norm: float, ratio: float | None) -> dict:
    return {"step": step, "micro_batch": micro_batch, "reason": reason, "values": values, "norm": _plain(norm),
            "ratio": _plain(ratio)}


def _warning(step: int, micro_batch: int, norm: float, ratio: float) -> dict:
    return {"step": step, "micro_batch": micro_batch, "norm": _plain(norm), "ratio": _plain(ratio)}


def _withholding(step: int, micro_batch: int, values: int) -> dict:
    return {"step": step, "micro_batch": micro_batch, "values": values}


def _plain(value: Any) -> Any:
    """A value as JSON keeps it: a float rounded, an infinite one as its text ("inf")."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else str(value)
    return value
