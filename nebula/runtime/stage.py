"""The stage-module protocol: what a workload implements for each stage of its graph.

A stage module declares its ports (what it receives and sends), its options (a dataclass, checked
when the job file loads) and the maths of one micro-batch; the runtime (nebula.runtime.runner)
owns the order of forward, send, receive, backward and optimiser step, the checkpoints and the
protocol with the other stages. A minimal module (docs/runtime.md has the whole example; a workload's
spec, nebula.workload, gives it the name a job file's `impl` uses):

    class Source(Stage):
        Options = SourceOptions                       # a dataclass: the stage's job-file keys
        outputs = (Port("hidden", "float", rank=2),)  # (B, H)

        def __init__(self, context, options):
            super().__init__(context, options)
            self.module = torch.nn.Linear(8, options.width)
            self.optimizer = torch.optim.SGD(self.module.parameters(), lr=options.lr)

        def examples(self, split):                    # a source stage reads its own data
            return [f"{split}:{i}" for i in range(64)]

        def forward(self, batch, inputs):             # batch.indices: which examples
            return Output(tensors={"hidden": torch.tanh(self.module(self.x[batch.indices]))})
"""
from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from nebula.errors import StageError
from nebula.runtime.metrics import MetricsLog
from nebula.security.grants import DataAccess
from nebula.wire import ITEMSIZE

if TYPE_CHECKING:  # the job loader imports this module (options_of), the runner drives stages: both above it
    from nebula.runtime.job import JobConfig
    from nebula.runtime.runner import StageRunner

FLOAT = "float"  # a port dtype: any floating-point dtype (codecs may change it on the wire, not after)


@dataclass(frozen=True)
class Port:
    """One named tensor a stage receives or sends. The first dimension is the batch."""

    name: str
    dtype: str  # "float", or an exact wire dtype: "int64", "bool", ...
    rank: int  # number of dimensions, e.g. 3 for (B, S, H)
    role: str = "activation"  # what it is (activation, tokens, mask, labels): shown in errors and meters
    optional: bool = False  # an input a link may leave out
    # The sizes after the batch dimension, where the stage knows them: a number, the name of one of its
    # options that holds it ("width"), or None for any; None: not declared. Checked against the other end
    # when the job loads and on every tensor received (a width mismatch was a torch error at step 1).
    shape: tuple[int | str | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype != FLOAT and self.dtype not in ITEMSIZE:
            raise StageError(f"port {self.name!r}: dtype {self.dtype!r} is not 'float' or one of {sorted(ITEMSIZE)}")
        if not 1 <= self.rank <= 8:
            raise StageError(f"port {self.name!r}: rank {self.rank} must be 1..8 (the batch dimension first)")
        if self.shape is not None and len(self.shape) != self.rank - 1:
            raise StageError(f"port {self.name!r}: shape {self.shape} must give the {self.rank - 1} sizes after the "
                             "batch dimension (None for any)")

    def dims(self, options: Any) -> tuple[int | None, ...] | None:
        """The declared sizes after the batch dimension, option names read from the stage's `options`."""
        if self.shape is None:
            return None
        sizes = []
        for size in self.shape:
            if isinstance(size, str):
                if not isinstance(getattr(options, size, None), int):
                    raise StageError(f"port {self.name!r}: its shape names option {size!r}, which the stage's "
                                     f"options ({type(options).__name__}) have not as an integer")
                size = getattr(options, size)
            sizes.append(size)
        return tuple(sizes)

    def accepts(self, tensor: torch.Tensor, batch: int | None = None) -> str | None:
        """Why `tensor` does not fit this port (for a batch of `batch` examples), or None."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if (self.dtype == FLOAT and not tensor.is_floating_point()) or self.dtype not in (FLOAT, dtype):
            return f"dtype {dtype}, expected {self.dtype}"
        if tensor.dim() != self.rank:
            return f"shape {tuple(tensor.shape)} of rank {tensor.dim()}, expected rank {self.rank}"
        if batch is not None and tensor.shape[0] != batch:
            return f"batch dimension {tensor.shape[0]} for {batch} examples"
        return None


@dataclass(frozen=True)
class Batch:
    """What one call of `forward` works on."""

    split: str  # "train", or the split being evaluated
    step: int  # the training step (during inference: the step whose weights are used)
    micro_batch: int
    ids: torch.Tensor  # (B,) int64 hashes of the example ids: how a stage finds its own side of the data
    training: bool = True  # False during inference (no gradients, modules in eval mode)
    indices: list[int] | None = None  # source stages: positions of the examples in their split
    link: str | None = None  # the in-link the inputs came on ("generator->disc"); None at a source


@dataclass
class Output:
    """What `forward` returns: tensors for the out-links (with their autograd graph) and/or a loss."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None  # scalar; the runtime divides it by the micro-batches per step
    stats: dict[str, float] = field(default_factory=dict)  # counts summed over the step (keys: Stage.stats)


@dataclass(frozen=True)
class NoOptions:
    """A stage without options of its own."""


@dataclass
class StageContext:
    """What the runtime hands a stage module when it builds it: everything the stage may use of the
    world outside its maths, resolved by the stage's entry point (nebula.runtime.service)."""

    name: str  # the stage's name in the job file
    address: str  # site/stage/rank of rank 0
    job: JobConfig
    workdir: Path  # checkpoints, metrics and the workload's outputs
    device: torch.device
    metrics: MetricsLog
    rank: int = 0
    world_size: int = 1
    access: DataAccess = field(default_factory=DataAccess)  # the site and the job it reads data for

    @functools.cached_property
    def data(self) -> Path | None:
        """The job's [job].data directory, if it names one (resolved against the job file), or the
        directory of `dataset:NAME` opened through this site's data grants for the job the stage runs
        for, once per stage process (DataAccess.open: refused and audited without a grant)."""
        return self.access.open(self.job.data)


class Stage(ABC):
    """One part of a model at one site. It never opens sockets; it computes."""

    stage_name: ClassVar[str] = ""  # the name it is registered under (nebula.runtime.registry)
    Options: ClassVar[type] = NoOptions
    inputs: ClassVar[tuple[Port, ...]] = ()
    outputs: ClassVar[tuple[Port, ...]] = ()
    # counts a forward may return in Output.stats, summed over a step's micro-batches and ranks into the
    # step's metrics record; "tokens" also gives bytes_per_token for each link the stage sends on
    stats: ClassVar[tuple[str, ...]] = ()

    module: torch.nn.Module  # its trainable parameters are what the runtime stashes, reduces and saves
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # a torch LR scheduler, stepped after each optimiser step

    def __init__(self, context: StageContext, options: Any):
        self.context, self.options = context, options
        self.device = context.device

    @classmethod
    def ports(cls, job: JobConfig, name: str) -> tuple[tuple[Port, ...], tuple[Port, ...]]:
        """(inputs, outputs) of stage `name` of `job`: the class's own, unless they depend on the job (a
        split model's boundary tensors are found by splitting it: services/split). The job loader, the
        runner and the executor read ports through this, never the class attributes."""
        return cls.inputs, cls.outputs

    # -- the maths ---------------------------------------------------------------------------
    @abstractmethod
    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        """One micro-batch. `inputs` are the received tensors, checked against `inputs` ports and on
        `self.device`; floating-point ones on a two-way link require grad."""

    def examples(self, split: str) -> Sequence[str]:
        """Source stages (no link feeds them): the ids of the examples of `split`, in a fixed order."""
        raise StageError(f"stage {self.context.name} is a source of the job graph: implement "
                         f"{type(self).__name__}.examples(split)")

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {k: p for k, p in self.module.named_parameters() if p.requires_grad}

    def optimizer_step(self, step: int) -> None:
        """Apply the accumulated (and, with ranks, all-reduced) gradients of `step`."""
        if self.optimizer is not None:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the trainable weights, the module's buffers (BatchNorm's running
        statistics: training changes them too), the optimiser and the LR schedule. Frozen weights are
        not kept: the stage builds them the same way again."""
        params = dict(self.module.named_parameters())
        state = {"weights": {k: p.detach().clone() for k, p in self.trainable().items()},
                 "buffers": {k: b.detach().clone() for k, b in self.module.state_dict().items() if k not in params}}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {**state.get("buffers", {}), **state["weights"]}
        missing = self.module.load_state_dict(saved, strict=False).missing_keys
        if set(self.trainable()) & set(missing):
            raise StageError(f"checkpoint of stage {self.context.name} lacks weights "
                             f"{sorted(set(self.trainable()) & set(missing))[:5]}: was it written by another model?")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    # -- the workload's hooks ------------------------------------------------------------------
    def after_training(self, runner: StageRunner) -> None:
        """Source stages, once training is over, e.g. `runner.evaluate("test", ...)`."""

    def infer(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> list[Any]:
        """Sink stages during inference: one result per example."""
        raise StageError(f"stage {self.context.name} ({self.stage_name}) cannot infer: implement "
                         f"{type(self).__name__}.infer()")

    def score(self, split: str, results: list[Any]) -> dict[str, Any]:
        """Sink stages after an inference pass: a JSON-able summary sent back to the stage that
        asked (e.g. a quality score). The default returns the results themselves."""
        return {"split": split, "n": len(results), "results": results}


def finished(device: torch.device) -> None:
    """Wait until `device` has run the work queued on it: CUDA kernels run asynchronously, so a clock
    read without this times their launches, not their compute."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def options_of(cls: type) -> type:
    options = getattr(cls, "Options", NoOptions)
    if not dataclasses.is_dataclass(options):
        raise StageError(f"{cls.__qualname__}.Options must be a dataclass, got {options!r}")
    return options
