"""Training split across two sites at one boundary tensor (paper Scenario II, Figure 7).

The head (site a) runs forward on micro-batch i+1 while i is on the wire or in the tail; the tail
(site b) computes the loss and returns dL/d(boundary) per micro-batch; each side applies its optimizer
once per step, after all micro-batches, so the result equals unpipelined training up to codec error.

Resume protocol (the head coordinates): a starting stage sends CONTROL `hello` with its checkpoint
steps and generation. The head answers any `hello` by choosing the last common checkpoint, bumping the
generation and sending `resume`; both sides load that checkpoint. Messages of an older generation are
dropped, so nothing from an abandoned step is ever applied.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nebula.errors import StageError, TransportError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import TrainConfig
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.schedule import Schedule, digest
from nebula.runtime.sender import BackgroundSender
from nebula.transport.base import Channel
from nebula.wire import Kind, Message


class SplitModel(Protocol):
    """What a stage's model offers the runner (both sides)."""

    def zero_grad(self) -> None: ...
    def optimizer_step(self, step: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class HeadModel(SplitModel, Protocol):
    def forward(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Tensors to send: "hidden" (the boundary, with autograd graph) goes through the codec,
        "ids" (B,) int64 example-id hashes tell the tail which targets to use."""


class TailModel(SplitModel, Protocol):
    def loss(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar loss from the received tensors (inputs["hidden"] requires grad)."""


class Resync(Exception):
    """The peer (re)started: abandon the current step and agree on a checkpoint again."""

    def __init__(self, body: dict[str, Any]):
        super().__init__("peer asked to resynchronise")
        self.body = body


@dataclass
class SplitRunner:
    """State and plumbing shared by both sides."""

    job: str
    channel: Channel
    peer: str
    model: SplitModel
    codecs: Any  # nebula.codecs.LinkCodecs: policy + per-link state
    train: TrainConfig
    checkpoints: CheckpointDir
    metrics: MetricsLog
    timeout: float = 300.0
    step: int = 0
    generation: int = 0
    ledger: list[list] = field(default_factory=list)  # [step, digest of example indices]

    def __post_init__(self) -> None:
        self.sender = BackgroundSender(self.channel, self.timeout)

    # -- messages -------------------------------------------------------------------------------
    def control(self, topic: str, **body: Any) -> None:
        msg = Message(kind=Kind.CONTROL, job=self.job, dst=self.peer, topic=topic,
                      body=json.dumps(body).encode(), generation=self.generation)
        self.sender.submit(lambda: msg)

    def recv(self) -> Message:
        msg = self.channel.recv(timeout=self.timeout)
        if msg.kind == Kind.ERROR:
            raise StageError(f"{self.peer} or its gateway refused a message: [{msg.error_code}] {msg.error_message}")
        return msg

    @staticmethod
    def body(msg: Message) -> dict[str, Any]:
        try:
            body = json.loads(msg.body or b"{}")
        except ValueError as exc:
            raise StageError(f"control message {msg.topic!r} from {msg.src} has a malformed body") from exc
        if not isinstance(body, dict):
            raise StageError(f"control message {msg.topic!r} from {msg.src}: body must be an object")
        return body

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self) -> None:
        self.checkpoints.save(self.step, {"model": self.model.state_dict(), "step": self.step,
                                          "ledger": self.ledger, "train_seed": self.train.seed})

    def restore(self, step: int) -> None:
        """Load checkpoint `step` (0: the fresh initial state saved at start)."""
        state = self.checkpoints.load(step)
        self.model.load_state_dict(state["model"])
        self.step, self.ledger = int(state["step"]), [list(e) for e in state["ledger"]]
        self.model.zero_grad()

    def ensure_initial_checkpoint(self) -> None:
        if 0 not in self.checkpoints.steps() and not self.checkpoints.steps():
            self.save()

    def hello(self) -> None:
        self.control("hello", checkpoints=self.checkpoints.steps(), generation=self.generation)

    def write_ledger(self, path: Path) -> None:
        path.write_text(json.dumps({"steps": self.ledger}))

    def close(self) -> None:
        self.sender.close()


class HeadRunner(SplitRunner):
    """Site a: reads the source side, runs ahead, coordinates resumes."""

    def run(self, schedule: Schedule) -> None:
        self.ensure_initial_checkpoint()
        self.hello()
        self.coordinate(self.await_hello())
        while self.step < self.train.steps:
            try:
                self.train_step(schedule, self.step + 1)
            except Resync as resync:
                self.coordinate(resync.body)

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

    @torch.no_grad()
    def evaluate(self, split: str, n: int, batch_size: int) -> dict[str, Any]:
        """Cross-site inference: boundary tensors of `split` go to the tail, which decodes and scores
        against the references only it holds; returns its `scores` body (e.g. BLEU)."""
        batches = 0
        for start in range(0, n, batch_size):
            out = self.model.forward(list(range(start, min(n, start + batch_size))), split)
            self.sender.submit(self._builder(self.step, batches, out, topic=f"infer:{split}"))
            batches += 1
        self.control("infer-done", split=split, batches=batches)
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "scores" and msg.generation == self.generation:
                return self.body(msg)

    def await_hello(self) -> dict[str, Any]:
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL and msg.topic == "hello":
                return self.body(msg)

    def coordinate(self, peer: dict[str, Any]) -> None:
        theirs = {int(s) for s in peer.get("checkpoints", [])}
        common = max(set(self.checkpoints.steps()) & theirs, default=None)
        if common is None:
            raise StageError(f"no common checkpoint with {self.peer}: mine {self.checkpoints.steps()}, "
                             f"theirs {sorted(theirs)}; start both stages from empty checkpoint dirs")
        self.generation = max(self.generation, int(peer.get("generation", 0))) + 1
        self.restore(common)
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

    def train_step(self, schedule: Schedule, step: int) -> None:
        started, indices = time.perf_counter(), schedule.indices(step)
        chunks = [indices[i::self.train.micro_batches] for i in range(self.train.micro_batches)]
        self.model.zero_grad()
        boundary, compute, ids = {}, 0.0, []
        for mb, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            out = self.model.forward(chunk)
            compute += time.perf_counter() - t0
            boundary[mb] = out["hidden"]
            ids += out["ids"].tolist()
            self.sender.submit(self._builder(step, mb, out))
        for _ in chunks:
            msg = self.next_grad(step)
            grad = self.codecs.unpack(msg.tensors[0])
            t0 = time.perf_counter()
            boundary.pop(msg.micro_batch).backward(grad)
            compute += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.model.optimizer_step(step)
        compute += time.perf_counter() - t0
        self.step = step
        self.ledger.append([step, digest(ids)])
        if step % self.train.checkpoint_every == 0 or step == self.train.steps:
            self.save()
        self.metrics.step(step=step, step_s=time.perf_counter() - started, compute_s=compute,
                          forward_bytes=self.codecs.take_bytes("forward"))

    def _builder(self, step: int, mb: int, out: dict[str, torch.Tensor], topic: str = ""):
        generation = self.generation

        def build() -> Message:  # runs on the sender thread: codec work overlaps the next forward
            tensors = [self.codecs.pack("forward", name, tensor.detach(), step)
                       for name, tensor in out.items()]
            return Message(kind=Kind.TENSORS, job=self.job, dst=self.peer, step=step, micro_batch=mb,
                           tensors=tensors, generation=generation, topic=topic)
        return build


class TailRunner(SplitRunner):
    """Site b: holds the target side and the loss; follows the head's schedule and resumes."""

    def run(self) -> None:
        self.ensure_initial_checkpoint()
        self.hello()
        pending, losses, self._ids = 0, [], []
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL:
                if msg.topic == "hello":
                    self.hello()
                elif msg.topic == "resume":
                    self.resume(msg)
                    pending, losses, self._ids = 0, [], []
                elif msg.topic == "infer-done" and msg.generation == self.generation:
                    self.score(self.body(msg).get("split", "test"))
                elif msg.topic == "done" and msg.generation == self.generation:
                    self.save()
                    self.control("done", step=self.step)
                    self.sender.flush()
                    return
            elif msg.kind == Kind.TENSORS and msg.topic.startswith("infer:") and msg.generation == self.generation:
                self.infer(msg)
            elif msg.kind == Kind.TENSORS and msg.generation == self.generation and msg.step == self.step + 1:
                losses.append(self.micro_batch(msg))
                pending += 1
                if pending == self.train.micro_batches:
                    self.finish_step(msg.step, losses)
                    pending, losses, self._ids = 0, [], []

    def infer(self, msg: Message) -> None:
        split = msg.topic.partition(":")[2]
        inputs = {t.name: self.codecs.unpack(t) for t in msg.tensors}
        self._hyps = getattr(self, "_hyps", []) + self.model.translate(inputs)
        self._refs = getattr(self, "_refs", []) + self.model.references(split, inputs["ids"])

    def score(self, split: str) -> None:
        from sacrebleu import corpus_bleu
        hyps, refs = getattr(self, "_hyps", []), getattr(self, "_refs", [])
        bleu = corpus_bleu(hyps, [refs], lowercase=True).score if hyps else 0.0
        scores = {"split": split, "bleu": bleu, "n": len(hyps),
                  "samples": [[h, r] for h, r in zip(hyps[:5], refs[:5])]}
        self.metrics.event("scores", **scores)
        self._hyps, self._refs = [], []
        self.control("scores", **scores)

    def resume(self, msg: Message) -> None:
        body = self.body(msg)
        self.generation = int(body["generation"])
        self.restore(int(body["step"]))
        self.control("ready", step=self.step)

    def micro_batch(self, msg: Message) -> float:
        t0 = time.perf_counter()
        inputs = {t.name: self.codecs.unpack(t) for t in msg.tensors}
        hidden = inputs["hidden"].detach().float().requires_grad_()
        inputs["hidden"] = hidden
        self._ids += inputs["ids"].tolist()
        loss = self.model.loss(inputs)
        (loss / self.train.micro_batches).backward()
        grad = hidden.grad
        step, mb, generation = msg.step, msg.micro_batch, self.generation
        self.sender.submit(lambda: Message(
            kind=Kind.TENSORS, job=self.job, dst=self.peer, step=step, micro_batch=mb, generation=generation,
            tensors=[self.codecs.pack("backward", "grad_hidden", grad, step)]))
        self._compute = getattr(self, "_compute", 0.0) + time.perf_counter() - t0
        return loss.item()

    def finish_step(self, step: int, losses: list[float]) -> None:
        t0 = time.perf_counter()
        self.model.optimizer_step(step)
        self.model.zero_grad()  # the next step accumulates its micro-batches from zero
        self.step = step
        self.ledger.append([step, digest(self._ids)])  # equals the head's entry: same example ids
        if step % self.train.checkpoint_every == 0:
            self.save()
        compute = getattr(self, "_compute", 0.0) + time.perf_counter() - t0
        self._compute = 0.0
        self.metrics.step(step=step, loss=sum(losses) / len(losses), compute_s=compute,
                          backward_bytes=self.codecs.take_bytes("backward"))
