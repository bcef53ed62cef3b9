"""One stage's maths, micro-batch by micro-batch: forward, backward, optimiser step. No sockets.

The runner (nebula.runtime.runner) decides *when*; the executor does the work and hands what must
cross a link to `emit(direction, link, step, micro_batch, tensors, ids)`. On rank 0 that queues a
message; on another rank of a data-parallel stage it goes to rank 0 first (nebula.runtime.ranks).

Which weights a step runs at is the schedule's (nebula.runtime.schedules): `weights.for_step(t)` gives
None for the live ones (W_{t-1}) or a stash (one-step-stale: W_{t-2}), which the forward then runs at
through torch.func.functional_call, so the stash's leaves collect the step's gradients.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nebula.errors import DataError, StageError
from nebula.runtime.graph import Graph, Item, LinkConfig
from nebula.runtime.job import JobConfig
from nebula.runtime.schedules import ExactWeights
from nebula.runtime.stage import Batch, Output, Stage, finished

Emit = Callable[[str, LinkConfig, int, int, dict, "torch.Tensor | None"], None]


@dataclass
class _Pending:
    """A forward whose gradients are awaited from the two-way out-links."""

    loss: torch.Tensor | None
    needs: dict[str, dict[str, torch.Tensor]]  # out-link -> tensors (with graph) that want a gradient
    leaves: dict[str, torch.Tensor]  # inputs from a two-way in-link: their .grad goes back
    item: Item


@dataclass
class Tally:
    """What one step cost and scored at this stage."""

    losses: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


class _Bound(torch.nn.Module):
    """The stage's forward as a module call, so functional_call can swap in stashed weights."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.inner, self._stage = stage.module, stage

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        return self._stage.forward(batch, inputs)


class Executor:
    def __init__(self, stage: Stage, graph: Graph, name: str, weights: ExactWeights, emit: Emit,
                 reduce: Callable[[list[torch.nn.Parameter]], None] | None = None):
        self.stage, self.graph, self.name, self.weights = stage, graph, name, weights
        self.emit, self.reduce = emit, reduce
        self.per_step = graph.per_step(name)
        self.waits = graph.waits_for_gradients(name)
        self.out_links = graph.out_links[name]
        self.ports = {p.name: p for p in type(stage).ports(stage.context.job, name)[1]}
        self.pending: dict[tuple[int, int], _Pending] = {}
        self.tallies: dict[int, Tally] = {}
        self._bound = _Bound(stage)

    @classmethod
    def for_job(cls, job: JobConfig, name: str, stage: Stage, emit: Emit,
                reduce: Callable[[list[torch.nn.Parameter]], None] | None = None) -> Executor:
        """Stage `name`'s executor, its weights policy from the job's schedule."""
        waits = job.graph.waits_for_gradients(name)
        return cls(stage, job.graph, name, job.schedule.weights(waits, job.train), emit, reduce)

    def ready_for(self, step: int) -> bool:
        """Whether step `step`'s forward may run now (the weights it needs exist)."""
        return self.weights.ready_for(step)

    # -- forward / backward ----------------------------------------------------------------------
    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor], item: Item) -> None:
        t0 = time.perf_counter()
        tally = self.tallies.setdefault(batch.step, Tally())
        try:
            weights = self.weights.for_step(batch.step, self.stage.trainable())
        except StageError as exc:
            raise StageError(f"{self.name}: {exc}") from exc
        leaves = {}
        if item.link is not None and item.link.backward:
            for name, tensor in list(inputs.items()):
                if tensor.is_floating_point():
                    inputs[name] = leaves[name] = tensor.detach().requires_grad_()
        self.stage.module.train(True)
        if weights is None:
            out = self.stage.forward(batch, inputs)
        else:
            named = {f"inner.{k}": v for k, v in weights.items()}
            out = torch.func.functional_call(self._bound, named, (batch, inputs), strict=False)
        self._check(out, batch)
        if batch.training:
            for key, value in out.stats.items():
                tally.stats[key] = tally.stats.get(key, 0.0) + float(value)
        for link in self.out_links:
            self.emit("forward", link, batch.step, item.index, {n: out.tensors[n].detach() for n in link.tensors},
                      batch.ids)
        needs = {link.name: {n: out.tensors[n] for n in link.tensors if out.tensors[n].requires_grad}
                 for link in self.out_links if link.backward}
        loss = None
        if out.loss is not None:
            tally.losses.append(float(out.loss.detach()))
            loss = out.loss / self.per_step  # the step's loss is the mean over its micro-batches
        pending = _Pending(loss, needs, leaves, item)
        if self.waits:
            self.pending[(batch.step, item.index)] = pending
        else:
            self._backprop(pending, [], [], batch.step)
        tally.compute_s += self._since(t0)

    def backward(self, step: int, index: int, grads: dict[str, dict[str, torch.Tensor]]) -> None:
        """Gradients for micro-batch `index` of `step` from every two-way out-link arrived."""
        t0 = time.perf_counter()
        pending = self.pending.pop((step, index))
        outs, given = [], []
        for link, needed in pending.needs.items():
            for name, tensor in needed.items():
                grad = grads[link][name]
                if grad.shape != tensor.shape:
                    raise DataError(f"the gradient of {name!r} on {link} has shape {tuple(grad.shape)} but "
                                    f"{self.name} sent {tuple(tensor.shape)}: both stages must run the same job")
                outs.append(tensor)
                given.append(grad.to(tensor.device, tensor.dtype))
        self._backprop(pending, outs, given, step)
        self.tallies.setdefault(step, Tally()).compute_s += self._since(t0)

    def _backprop(self, pending: _Pending, outs: list, grads: list, step: int) -> None:
        tensors, given = list(outs), list(grads)
        if pending.loss is not None and pending.loss.requires_grad:
            tensors.insert(0, pending.loss)
            given.insert(0, None)
        if tensors:
            torch.autograd.backward(tensors, given)
        link = pending.item.link
        if link is not None and link.backward:
            back = {name: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    for name, leaf in pending.leaves.items()}
            self.emit("backward", link, step, pending.item.micro_batch, back, None)

    # -- the optimiser step --------------------------------------------------------------------
    def apply(self, step: int) -> Tally:
        t0 = time.perf_counter()
        params = self.stage.trainable()
        self.weights.before_update(step, params)  # one step stale: keeps W_{step-1}, takes the stash's gradients
        if self.reduce is not None:
            self.reduce(list(params.values()))
        self.stage.optimizer_step(step)
        for param in params.values():
            param.grad = None
        self.weights.updated(step)
        tally = self.tallies.pop(step, Tally())
        tally.compute_s += self._since(t0)
        return tally

    def _since(self, t0: float) -> float:
        """Seconds of compute since t0, once the device has run what was queued: on CUDA, compute_s
        would otherwise time kernel launches, and `auto` (which budgets the wire against compute) and
        the busy fractions would read a GPU stage as idle."""
        finished(self.stage.device)
        return time.perf_counter() - t0

    def reset(self, step: int) -> None:
        """After a restore: whatever was in flight is void."""
        self.pending.clear()
        self.tallies.clear()
        self.weights.reset(step)
        for param in self.stage.trainable().values():
            param.grad = None

    # -- inference -------------------------------------------------------------------------------
    @torch.no_grad()
    def infer_forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        self.stage.module.train(False)
        out = self.stage.forward(batch, inputs)
        self._check(out, batch)
        return out

    # -- helpers -----------------------------------------------------------------------------------
    def _check(self, out: Any, batch: Batch) -> None:
        if not isinstance(out, Output):
            raise StageError(f"{type(self.stage).__name__}.forward must return an Output, got {type(out).__name__}")
        for link in self.out_links:
            for name in link.tensors:
                tensor = out.tensors.get(name)
                if tensor is None:
                    raise StageError(f"{type(self.stage).__name__}.forward returned no {name!r}, which link "
                                     f"{link.name} sends (returned: {', '.join(out.tensors) or 'none'})")
                why = self.ports[name].accepts(tensor, batch.ids.shape[0])
                if why:
                    raise StageError(f"{type(self.stage).__name__}.forward returned {name!r} with {why} "
                                     f"(its output port: {self.ports[name]})")
        if out.loss is not None and (not isinstance(out.loss, torch.Tensor) or out.loss.numel() != 1):
            raise StageError(f"{type(self.stage).__name__}.forward returned a loss that is not a scalar tensor")
        unknown = set(out.stats) - set(type(self.stage).stats)
        if unknown:
            raise StageError(f"{type(self.stage).__name__}.forward returned stats {sorted(unknown)} that its "
                             f"class does not declare (stats = {type(self.stage).stats})")

