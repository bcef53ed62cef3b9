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

This module holds what both sides share; the sides are nebula.runtime.head.HeadRunner and
nebula.runtime.tail.TailRunner.
"""
from __future__ import annotations

import functools
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nebula.errors import RemoteError, StageError, TransportError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import TrainConfig
from nebula.runtime.metrics import MetricsLog
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
