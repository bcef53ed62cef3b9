"""One stage's maths in this process, micro-batch by micro-batch: forward, backward (whole, or its input
and weight halves apart), optimiser step. No sockets (nebula.runtime.compute, the interface).

The schedule decides *when*; the executor does the work and hands what must cross a link to
`emit(direction, link, step, micro_batch, tensors, ids)`. On rank 0 that queues a message (the stage's
outbox); on another rank of a data-parallel stage it goes to rank 0 first (nebula.runtime.ranks).

Which weights a step runs at is the schedule's (nebula.runtime.schedules): `weights.for_step(t)` gives
None for the live ones (W_{t-1}) or a stash (one-step-stale: W_{t-2}), which the forward then runs at
through torch.func.functional_call, so the stash's leaves collect the step's gradients.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nebula.errors import DataError, StageError
from nebula.runtime import split_backward
from nebula.runtime.compute import Compute, Emit, Part, Tally
from nebula.runtime.graph import Graph, Item
from nebula.runtime.job import JobConfig
from nebula.runtime.schedules import ExactWeights
from nebula.runtime.stage import Batch, Output, Stage, finished


@dataclass
class _Pending:
    """A forward whose backward has not run (or whose weight half has not)."""

    loss: torch.Tensor | None
    needs: dict[str, dict[str, torch.Tensor]]  # out-link -> tensors (with graph) that want a gradient
    leaves: dict[str, torch.Tensor]  # inputs from a two-way in-link: their gradient goes back
    item: Item
    params: dict[str, torch.Tensor]  # the weights the forward ran at (live, or a stash)
    weight_half: Callable[[], None] | None = None  # after the input half: the weight gradients


class _Bound(torch.nn.Module):
    """The stage's forward as a module call, so functional_call can swap in stashed weights."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.inner, self._stage = stage.module, stage

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        return self._stage.forward(batch, inputs)


class Executor(Compute):
    def __init__(self, stage: Stage, graph: Graph, name: str, weights: ExactWeights, emit: Emit,
                 reduce: Callable[[list[torch.nn.Parameter]], None] | None = None):
        self.stage, self.graph, self.name, self.weights = stage, graph, name, weights
        self.emit, self.reduce = emit, reduce
        self.per_step = graph.per_step(name)
        self.out_links = graph.out_links[name]
        self.ports = {p.name: p for p in type(stage).ports(stage.context.job, name)[1]}
        self.pending: dict[tuple[int, int], _Pending] = {}
        self.tallies: dict[int, Tally] = {}
        self._bound = _Bound(stage)
        self._split: bool | None = None  # whether the two backward halves are exact here (found once)

    @classmethod
    def for_job(cls, job: JobConfig, name: str, stage: Stage, emit: Emit,
                reduce: Callable[[list[torch.nn.Parameter]], None] | None = None) -> Executor:
        """Stage `name`'s executor, its weights policy from the job's schedule."""
        waits = job.graph.waits_for_gradients(name)
        return cls(stage, job.graph, name, job.schedule.weights(waits, job.train), emit, reduce)

    def ready_for(self, step: int) -> bool:
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
        params: dict[str, torch.Tensor] = dict(self.stage.trainable() if weights is None else weights)
        self.pending[(batch.step, item.index)] = _Pending(loss, needs, leaves, item, params)
        tally.compute_s += self._since(t0)

    def backward(self, step: int, index: int, grads: dict[str, dict[str, torch.Tensor]], part: Part) -> None:
        t0 = time.perf_counter()
        if part == "weight":
            pending = self.pending.pop((step, index))
            if pending.weight_half is not None:  # None: the input half ran the whole backward
                pending.weight_half()
        else:
            pending = self.pending[(step, index)]
            roots, given = self._roots(pending, grads, step)
            if part == "input" and pending.leaves and roots and self._exact(pending, roots):
                back, pending.weight_half = split_backward.backward_input(
                    roots, given, list(pending.leaves.values()), list(pending.params.values()))
                self._send_back(pending, step, dict(zip(pending.leaves, back)))
            else:
                self._whole(pending, roots, given, step)
            if part == "all":
                del self.pending[(step, index)]
        self.tallies.setdefault(step, Tally()).compute_s += self._since(t0)

    def _roots(self, pending: _Pending, grads: dict[str, dict[str, torch.Tensor]], step: int) -> tuple[list, list]:
        """The tensors to backpropagate from and their gradients (None: the stage's scalar loss)."""
        roots: list[torch.Tensor] = []
        given: list[torch.Tensor | None] = []
        if pending.loss is not None and pending.loss.requires_grad:
            roots.append(pending.loss)
            given.append(None)
        for link, needed in pending.needs.items():
            for name, tensor in needed.items():
                grad = grads[link][name]
                if grad.shape != tensor.shape:
                    raise DataError(f"the gradient of {name!r} on {link} has shape {tuple(grad.shape)} but "
                                    f"{self.name} sent {tuple(tensor.shape)}: both stages must run the same job")
                roots.append(tensor)
                given.append(grad.to(tensor.device, tensor.dtype))
        return roots, given

    def _exact(self, pending: _Pending, roots: list) -> bool:
        """Whether the halves are exact for this stage's graph: found at its first backward, kept."""
        if self._split is None:
            self._split = split_backward.exact(roots, list(pending.leaves.values()), list(pending.params.values()))
        return self._split

    def _whole(self, pending: _Pending, roots: list, given: list, step: int) -> None:
        if roots:
            torch.autograd.backward(roots, given)
        if pending.leaves:
            self._send_back(pending, step, {name: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                                            for name, leaf in pending.leaves.items()})

    def _send_back(self, pending: _Pending, step: int, back: dict[str, torch.Tensor]) -> None:
        link = pending.item.link
        assert link is not None and link.backward  # leaves come only from a two-way in-link
        self.emit("backward", link, step, pending.item.micro_batch, back, None)

    # -- the optimiser step --------------------------------------------------------------------
    def apply(self, step: int, ahead: Callable[[], None] | None = None) -> Tally:
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

    def skip(self, step: int) -> None:
        """No update for `step` (a bad tensor's): the weights policy moves on as after one (a stash keeps
        what the next step runs at), the gradients and the graphs of its micro-batches are dropped."""
        params = self.stage.trainable()
        self.weights.before_update(step, params)
        for param in params.values():
            param.grad = None
        self.weights.updated(step)
        self.tallies.pop(step, None)
        for key in [k for k in self.pending if k[0] == step]:
            del self.pending[key]

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

