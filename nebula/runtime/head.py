"""The head of a split job (site a): reads the source side, runs ahead of the tail, coordinates
resumes and drives cross-site inference (see nebula.runtime.split for the protocol)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula.errors import StageError
from nebula.runtime.schedule import Schedule, digest
from nebula.runtime.split import Resync, SplitRunner, reports_failure
from nebula.wire import Kind, Message


@dataclass
class InFlight:
    """A step whose forward has run at the head and whose gradients are awaited."""

    step: int
    started: float
    boundary: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> output, with its graph
    ids: list[int] = field(default_factory=list)  # example-id hashes, for the ledger
    weights: dict[str, torch.Tensor] | None = None  # staleness 1: the stashed weights this forward used
    compute_s: float = 0.0


@dataclass
class HeadRunner(SplitRunner):
    """Site a: reads the source side, runs ahead, coordinates resumes."""

    last_update: float | None = field(default=None, init=False)  # when the last optimizer step ended

    @reports_failure
    def start(self) -> None:
        """Agree with the tail on the last common checkpoint and load it."""
        self.ensure_initial_checkpoint()
        self.hello()
        self.coordinate(self.await_hello())

    def run(self, schedule: Schedule) -> None:
        self.start()
        ahead = None  # the next step, when its forward ran before this step's update (staleness 1)
        while self.step < self.train.steps:
            try:
                ahead = self.advance(schedule, ahead)
            except Resync as resync:
                ahead = None  # abandoned with the rest of the step: the checkpoint decides what runs next
                self.coordinate(resync.body)

    @reports_failure
    def finish(self) -> None:
        """Tell the tail the job is over and wait until it has saved its final state."""
        self.control("done", step=self.step)
        self.sender.flush()
        while True:  # the tail confirms it saved the final state
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "done" and msg.generation == self.generation:
                return
            if msg.kind == Kind.CONTROL and msg.topic == "hello":
                self.coordinate(self.body(msg))
                self.control("done", step=self.step)

    @reports_failure
    @torch.no_grad()
    def evaluate(self, split: str, indices: list[int], batch_size: int) -> dict[str, Any]:
        """Cross-site inference on examples `indices` of `split`: boundary tensors go to the tail, which
        decodes and scores against the references only it holds; returns its `scores` body (e.g. BLEU,
        translations in the order of `indices`)."""
        batches = 0
        for start in range(0, len(indices), batch_size):
            out = self.model.forward(indices[start:start + batch_size], split)
            self.sender.submit(self._builder(self.step, batches, out, topic=f"infer:{split}"))
            batches += 1
        self.control("infer-done", split=split, batches=batches)
        while True:  # each decoded batch is reported, so `timeout` bounds one batch, not the pass
            msg = self.recv()
            if msg.kind != Kind.CONTROL or msg.generation != self.generation:
                continue
            if msg.topic == "scores":
                return self.body(msg)
            if msg.topic == "infer-progress":
                done = self.body(msg).get("n", 0)
                if done == len(indices) or done % (8 * batch_size) < batch_size:
                    self.metrics.event("decoded", split=split, n=done, of=len(indices))

    def await_hello(self) -> dict[str, Any]:
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "hello":
                return self.body(msg)

    def coordinate(self, peer: dict[str, Any]) -> None:
        theirs, mine = {int(s) for s in peer.get("checkpoints", [])}, self.good_checkpoints()
        common = max(set(mine) & theirs, default=None)
        if common is None:
            raise StageError(f"no common checkpoint with {self.peer}: mine {mine}, "
                             f"theirs {sorted(theirs)}; start both stages from empty checkpoint dirs")
        self.generation = max(self.generation, int(peer.get("generation", 0))) + 1
        self.restore(common)
        self.last_update = None
        self.control("resume", step=common, generation=self.generation)
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "ready" and msg.generation == self.generation:
                self.metrics.event("resumed", step=common, generation=self.generation)
                return

    def next_grad(self, step: int) -> Message:
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "hello":
                raise Resync(self.body(msg))
            if msg.kind == Kind.TENSORS and msg.generation == self.generation and msg.step == step:
                return msg

    def advance(self, schedule: Schedule, ahead: "InFlight | None") -> "InFlight | None":
        """Apply one step's gradients. With staleness 1, first start the next step's forward, so the
        wire and the tail never wait for this update (returned: the step now in flight). Not across a
        checkpoint: the saved state is then exactly what a resumed run starts from."""
        current = ahead or self.forward_step(schedule, self.step + 1)
        nxt = None
        if self.train.staleness and not self.saves_after(current.step):
            nxt = self.forward_step(schedule, current.step + 1)
        self.backward_step(current)
        return nxt

    def saves_after(self, step: int) -> bool:
        """A checkpoint follows this step (and the last step): the head must not run ahead of it."""
        return step % self.train.checkpoint_every == 0 or step == self.train.steps

    def forward_step(self, schedule: Schedule, step: int) -> "InFlight":
        """Forward every micro-batch of `step` and queue it for sending (codec work on the sender thread)."""
        flight = InFlight(step=step, started=time.perf_counter())
        if self.train.staleness:  # weight stashing: this step's graph keeps the weights it ran with
            flight.weights = {k: p.detach().clone().requires_grad_() for k, p in self.model.trainable().items()}
        else:
            self.model.zero_grad()
        indices = schedule.indices(step)
        for mb in range(self.train.micro_batches):
            t0 = time.perf_counter()
            out = self.model.forward(indices[mb::self.train.micro_batches], weights=flight.weights)
            flight.compute_s += time.perf_counter() - t0
            flight.boundary[mb] = out["hidden"]
            flight.ids += out["ids"].tolist()
            self.sender.submit(self._builder(step, mb, out))
        return flight

    def backward_step(self, flight: "InFlight") -> None:
        """Backward each micro-batch as its gradient arrives, then one optimizer step."""
        while flight.boundary:
            msg = self.next_grad(flight.step)
            grad = self.codecs.unpack(msg.tensors[0])
            t0 = time.perf_counter()
            flight.boundary.pop(msg.micro_batch).backward(grad)
            flight.compute_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if flight.weights is not None:  # gradients at the stashed weights, applied to the current ones
            for name, param in self.model.trainable().items():
                param.grad = flight.weights[name].grad
        self.model.optimizer_step(flight.step)
        flight.compute_s += time.perf_counter() - t0
        now, step = time.perf_counter(), flight.step
        since = flight.started if self.last_update is None else self.last_update  # update to update
        self.step, self.last_update = step, now
        self.ledger.append([step, digest(flight.ids)])
        if self.saves_after(step):
            self.save()
        self.metrics.step(step=step, step_s=now - since, compute_s=flight.compute_s,
                          forward_bytes=self.codecs.take_bytes("forward"))

    def _builder(self, step: int, mb: int, out: dict[str, torch.Tensor], topic: str = ""):
        generation = self.generation

        def build() -> Message:  # runs on the sender thread: codec work overlaps the next forward
            tensors = [self.codecs.pack("forward", name, tensor.detach(), step)
                       for name, tensor in out.items()]
            return Message(kind=Kind.TENSORS, job=self.job, dst=self.peer, step=step, micro_batch=mb,
                           tensors=tensors, generation=generation, topic=topic)
        return build
