"""Training split across two sites at one boundary tensor (paper Scenario II, Figure 7).

The head (site a) runs forward on micro-batch i+1 while i is on the wire or in the tail; the tail
(site b) computes the loss and returns dL/d(boundary) per micro-batch; each side applies its optimizer
once per step, after all micro-batches, so the result equals unpipelined training up to codec error.
That synchronous schedule pays a pipeline fill and drain every step. With `[train] staleness = 1` the
head starts step t+1's forward before applying step t's gradients (PipeDream-2BW weight stashing:
each step's backward runs at the weights its forward used, and its gradient updates the current ones),
so the link and the tail never wait for an update; the tail stays exact (it sees its steps in order).

Resume protocol (the head coordinates): a starting stage sends CONTROL `hello` with its checkpoint
steps and generation. The head answers any `hello` by choosing the last common checkpoint, bumping the
generation and sending `resume`; both sides load that checkpoint. Messages of an older generation are
dropped, so nothing from an abandoned step is ever applied. A checkpoint whose checksum does not match
is never advertised: the stage falls back to an earlier one (with a warning) instead of failing to load.

Failures: a stage that fails on its own (bad configuration, data that does not fit the model, a bug)
tells its peer with an ERROR message (code "stage") before it exits, so the peer stops with a
RemoteError naming the cause instead of waiting for a dead partner.
"""
from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nebula.errors import DataError, RemoteError, StageError, TransportError
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
    def forward(self, indices: list[int], split: str = "train",
                weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Tensors to send: "hidden" (the boundary, with autograd graph) goes through the codec,
        "ids" (B,) int64 example-id hashes tell the tail which targets to use. `weights` replace the
        trainable parameters of the same names for this call (torch.func.functional_call)."""

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer updates, by name."""


class TailModel(SplitModel, Protocol):
    def loss(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar loss from the received tensors (inputs["hidden"] requires grad)."""


def reports_failure(method):
    """Tell the peer why this stage is failing before the error propagates (see SplitRunner.report)."""
    @functools.wraps(method)
    def wrapper(self: "SplitRunner", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (TransportError, RemoteError):
            raise  # the link or the peer failed: there is nothing to tell it (and no error loops)
        except Exception as exc:
            self.report(exc)
            raise
    return wrapper


INPUT_SPLIT = "input"  # sentences given to `nebula translate`, translated but not scored


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
    verified: dict[tuple, bool] = field(default_factory=dict, init=False, repr=False)  # checksum results

    def __post_init__(self) -> None:
        self.sender = BackgroundSender(self.channel, self.timeout)

    # -- messages -------------------------------------------------------------------------------
    def control(self, topic: str, **body: Any) -> None:
        msg = Message(kind=Kind.CONTROL, job=self.job, dst=self.peer, topic=topic,
                      body=json.dumps(body).encode(), generation=self.generation)
        self.sender.submit(lambda: msg)

    def recv(self) -> Message:
        msg = self.channel.recv(timeout=self.timeout)
        if msg.kind == Kind.ERROR:  # gateways' refusals are handled by the channel: this is the peer's
            raise RemoteError(msg.error_code, f"{msg.src or self.peer} failed: {msg.error_message}; "
                                              "fix the cause there, then restart both stages")
        return msg

    def report(self, exc: BaseException, timeout: float = 5.0) -> None:
        """Best effort: send the peer an ERROR naming `exc`; the failing stage exits anyway."""
        text = f"{type(exc).__name__}: {exc}"[:4000]
        msg = Message(kind=Kind.ERROR, job=self.job, dst=self.peer, error_code="stage", error_message=text,
                      step=self.step, generation=self.generation)
        try:
            self.channel.send(msg, timeout=timeout)  # direct: the sender thread may be the one that failed
        except Exception as send_exc:  # noqa: BLE001 - reporting must not hide the original error
            print(f"warning: could not report the failure to {self.peer}: {send_exc}", file=sys.stderr)

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

    def good_checkpoints(self) -> list[int]:
        """Steps whose checkpoint matches its checksum; a corrupt one is skipped with a warning.
        Each file is hashed once per (size, mtime): a few MB of adapters and optimizer state."""
        good = []
        for step in self.checkpoints.steps():
            path = self.checkpoints.file(step)
            try:
                stat = path.stat()
                key = (step, stat.st_size, stat.st_mtime_ns)
                if key not in self.verified:
                    expected = path.with_name(f"{path.name}.sha256").read_text().strip()
                    self.verified[key] = hashlib.sha256(path.read_bytes()).hexdigest() == expected
                    if not self.verified[key]:
                        self.warn(f"checkpoint {path} is corrupt (checksum mismatch): skipping it, an earlier "
                                  "checkpoint will be used; delete the file to silence this warning")
            except FileNotFoundError:
                continue  # pruned meanwhile
            if self.verified[key]:
                good.append(step)
        return good

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
        self.metrics.event("warning", message=text)

    def ensure_initial_checkpoint(self) -> None:
        if not self.checkpoints.steps():
            self.save()

    def hello(self) -> None:
        self.control("hello", checkpoints=self.good_checkpoints(), generation=self.generation)

    def write_ledger(self, path: Path) -> None:
        path.write_text(json.dumps({"steps": self.ledger}))

    def close(self) -> None:
        self.sender.close()


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
        if self.train.staleness and current.step < self.train.steps and current.step % self.train.checkpoint_every:
            nxt = self.forward_step(schedule, current.step + 1)
        self.backward_step(current)
        return nxt

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
        if step % self.train.checkpoint_every == 0 or step == self.train.steps:
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


@dataclass
class StepProgress:
    """What the tail has accumulated of the step in flight (and of an inference pass)."""

    losses: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # example-id hashes, for the ledger
    compute_s: float = 0.0
    hyps: list[str] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)


@dataclass
class TailRunner(SplitRunner):
    """Site b: holds the target side and the loss; follows the head's schedule and resumes."""

    progress: StepProgress = field(default_factory=StepProgress)

    @reports_failure
    def run(self) -> None:
        self.ensure_initial_checkpoint()
        self.hello()
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL:
                if msg.topic == "hello":
                    self.hello()
                elif msg.topic == "resume":
                    self.resume(msg)
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
                self.micro_batch(msg)
                if len(self.progress.losses) == self.train.micro_batches:
                    self.finish_step(msg.step)

    def infer(self, msg: Message) -> None:
        split = msg.topic.partition(":")[2]
        inputs = self.received(msg)
        self.progress.hyps += self.model.translate(inputs)
        if split != INPUT_SPLIT:  # user input has no references at this site
            self.progress.refs += self.model.references(split, inputs["ids"])

    def received(self, msg: Message) -> dict[str, torch.Tensor]:
        """The tensors of a head message, checked: "hidden" floating point (B, S, H), "ids" int64 (B,)."""
        inputs = {t.name: self.codecs.unpack(t) for t in msg.tensors}
        missing = sorted({"hidden", "ids"} - inputs.keys())
        if missing:
            raise DataError(f"{msg.src} sent step {msg.step} without tensor(s) {', '.join(missing)} "
                            f"(got {', '.join(sorted(inputs)) or 'none'}): both stages must run the same job")
        hidden, ids = inputs["hidden"], inputs["ids"]
        if not hidden.is_floating_point():
            raise DataError(f"{msg.src} sent 'hidden' as {hidden.dtype}, expected a floating-point (B, S, H) "
                            "boundary tensor: check the head stage's model and the [compression] codecs")
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.shape[0] != hidden.shape[0]:
            raise DataError(f"{msg.src} sent 'ids' {ids.dtype} {tuple(ids.shape)} for 'hidden' "
                            f"{tuple(hidden.shape)}: expected int64 (B,) example-id hashes, one per row")
        return inputs

    def score(self, split: str) -> None:
        from sacrebleu import corpus_bleu
        hyps, refs = self.progress.hyps, self.progress.refs
        self.progress.hyps, self.progress.refs = [], []
        if split == INPUT_SPLIT:
            self.control("scores", split=split, n=len(hyps), translations=hyps)
            return
        bleu = corpus_bleu(hyps, [refs], lowercase=True).score if hyps else 0.0
        scores = {"split": split, "bleu": bleu, "n": len(hyps),
                  "samples": [[h, r] for h, r in zip(hyps[:5], refs[:5])]}
        self.metrics.event("scores", **scores)
        self.control("scores", **scores)

    def resume(self, msg: Message) -> None:
        body = self.body(msg)
        self.generation = int(body["generation"])
        self.restore(int(body["step"]))
        self.progress = StepProgress()  # whatever the abandoned step had accumulated is void
        self.control("ready", step=self.step)

    def micro_batch(self, msg: Message) -> None:
        t0 = time.perf_counter()
        inputs = self.received(msg)
        hidden = inputs["hidden"].detach().float().requires_grad_()
        inputs["hidden"] = hidden
        loss = self.model.loss(inputs)
        (loss / self.train.micro_batches).backward()
        grad = hidden.grad
        step, mb, generation = msg.step, msg.micro_batch, self.generation
        self.sender.submit(lambda: Message(
            kind=Kind.TENSORS, job=self.job, dst=self.peer, step=step, micro_batch=mb, generation=generation,
            tensors=[self.codecs.pack("backward", "grad_hidden", grad, step)]))
        self.progress.ids += inputs["ids"].tolist()
        self.progress.losses.append(loss.item())
        self.progress.compute_s += time.perf_counter() - t0

    def finish_step(self, step: int) -> None:
        t0 = time.perf_counter()
        self.model.optimizer_step(step)
        self.model.zero_grad()  # the next step accumulates its micro-batches from zero
        self.step = step
        self.ledger.append([step, digest(self.progress.ids)])  # equals the head's entry: same example ids
        if step % self.train.checkpoint_every == 0:
            self.save()
        done, self.progress = self.progress, StepProgress(hyps=self.progress.hyps, refs=self.progress.refs)
        self.metrics.step(step=step, loss=sum(done.losses) / len(done.losses),
                          compute_s=done.compute_s + time.perf_counter() - t0,
                          backward_bytes=self.codecs.take_bytes("backward"))
