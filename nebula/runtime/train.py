"""The job's [train] table: the framework's training keys (docs/runtime.md, "The job file")."""
from __future__ import annotations

from dataclasses import dataclass, field

from nebula.config import limits
from nebula.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = field(default=300, metadata=limits(at_least=1))
    batch_size: int = field(default=32, metadata=limits(at_least=1, hint="examples per step, per source stage"))
    micro_batches: int = field(default=4, metadata=limits(at_least=1))
    seed: int = field(default=1, metadata=limits(at_least=0, at_most=2**32 - 1))  # example order, each stage's init
    checkpoint_every: int = field(default=25, metadata=limits(at_least=1))
    log_every: int = field(default=10, metadata=limits(at_least=1))
    tensorboard: bool = False  # rank 0 of each stage also writes its step records as TensorBoard scalars

    def __post_init__(self) -> None:
        if self.batch_size % self.micro_batches:
            raise ConfigError(f"batch_size {self.batch_size} must be a multiple of micro_batches {self.micro_batches}")

    def saves_after(self, step: int) -> bool:
        """A checkpoint follows this step (and the last): no stage runs ahead across it, so the saved
        state is exactly what a resumed run starts from."""
        return step % self.checkpoint_every == 0 or step == self.steps
