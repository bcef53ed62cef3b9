"""The runtime of one stage: a message pump that executes its schedule's actions.

`pump(until)` executes every action the schedule names (nebula.runtime.schedules, from the stage's
board: what has arrived, what has run) and, when it names none, receives one message and puts it where
it goes: data on the board (decoded and checked by its link), control to the component that takes its
topic. Its parts are one object each, built here and handed only what they use (docs/runtime.md, "Inside
a stage"): board, compute (this process or its ranks), outbox (links, control), inbox (receive, whom it
waits for), progress (ledger, checkpoints), coordinator role, generations, inference, guard (bad tensors), replicas.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from nebula.errors import LinkDown, RemoteError, StageError, TransportError
from nebula.runtime import control as ctl
from nebula.runtime import coordinator, inference, replicas
from nebula.runtime.actions import Action, Apply, Backward, BackwardWeight, Forward, Open, Skip, Sync
from nebula.runtime.board import Board, StepState
from nebula.runtime.checkpoint import mark_finished
from nebula.runtime.control import DataKind, Topic
from nebula.runtime.coordinator import PROTOCOL, Role
from nebula.runtime.executor import Executor
from nebula.runtime.generations import Generations, Resync
from nebula.runtime.guard import Guard
from nebula.runtime.inbox import Inbox, awaited
from nebula.runtime.inference import Inference
from nebula.runtime.job import JobConfig
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.order import Examples
from nebula.runtime.outbox import Outbox
from nebula.runtime.progress import Progress
from nebula.runtime.ranks import RankGroup
from nebula.runtime.schedules import Pace
from nebula.runtime.stage import Stage
from nebula.transport.base import Channel
from nebula.wire import Kind, Message


class StageRunner:
    def __init__(self, job: JobConfig, name: str, stage: Stage, channel: Channel, workdir: Path,
                 metrics: MetricsLog, ranks: RankGroup | None = None, timeout: float = 300.0):
        self.job, self.name, self.stage, self.metrics = job, name, stage, metrics
        self.train, self.schedule, graph = job.train, job.schedule, job.graph
        self.generations = Generations(name)
        self.examples = Examples(stage, job)
        self.outbox = Outbox(job, name, type(stage).ports(job, name), channel, workdir, metrics, self.generations,
                             lambda: self.board.applied, timeout)
        self.compute = ranks if ranks is not None else Executor.for_job(job, name, stage, self.outbox.emit)
        if ranks is not None:
            ranks.attach(self.outbox.emit, lambda: self.generations.current)
        pace = Pace(self.schedule.credit, graph.in_links[name], graph.out_links[name])
        self.board = Board(name, graph, job.train, pace, self.compute.ready_for)
        self.progress = Progress(job, stage, workdir, metrics, self.board, self.outbox, self.compute)
        self.guard = Guard(job.integrity.on_bad, self.outbox, self.compute, self.progress, lambda: self.role,
                           lambda t: self.outbox.paced(self.board.pace.senders, t))
        self.replicas = replicas.attach(replicas.Handle(name, job, stage, self.outbox, self.compute, self.progress,
                                                        metrics, self.pump), self.board)
        self.inference = Inference(inference.Handle(name, graph, stage, self.compute, self.outbox, self.progress,
                                                    metrics, self.pump, self.examples.hashes))
        self.role = Role.of(coordinator.Handle(name, graph, self.progress, self.outbox, self.generations, metrics,
                                               self.pump, self.abandon,
                                               lambda: self.generations.replay(self.handle)))
        self.inbox = Inbox(channel, name, self.outbox.addresses, metrics, timeout, self.compute, ranks is not None,
                           lambda: awaited(self.role, self.board, self.outbox, self.train.steps), self.guard.withheld)

    @property
    def step(self) -> int:
        """The last step applied."""
        return self.board.applied

    # -- lifecycle ---------------------------------------------------------------------------------
    def run(self, hook: Callable[[StageRunner], Any] | None = None, train: bool = True) -> Any:
        """Start, train to [train].steps (a source drives it), run `hook` (default: the stage's
        after_training, at sources), and end the job together with the other stages."""
        try:
            first = self.start()
            result, hooked_at = None, None
            while True:
                try:
                    self.replicas.join(first)  # with replicas: meet the others (again after a resume)
                    first = False
                    if train and self.board.source:
                        self._train_to(self.train.steps)
                    if (hook is not None or (train and self.board.source)) and hooked_at != self.step:
                        # once per final state (again only after a roll-back)
                        if hook is not None:
                            result = hook(self)
                        else:
                            self.stage.after_training(self)
                        hooked_at = self.step
                    self.role.end(self.train.steps if train else self.step)
                    break
                except Resync as resync:
                    self.role.recover(resync)
            self.progress.final()
            self.role.final()
            self.outbox.sender.flush()
            if train:
                mark_finished(self.progress.workdir, self.train.steps)
            return result
        except LinkDown as exc:  # another site stayed unreachable: say where the job resumes from
            raise self.progress.link_down(exc) from exc
        except (TransportError, RemoteError):
            raise  # the link or a peer failed: there is nothing to tell the others
        except Exception as exc:  # not KeyboardInterrupt & co: an interrupted stage is restarted, not blamed
            self.outbox.report(exc)
            raise

    def start(self) -> bool:
        """Agree with every other stage on the last checkpoint they all hold, and load it; -> whether
        this stage starts for the first time (nothing saved yet)."""
        # where it computes, first in its log: `device = "auto"` picks cuda when there is one
        self.metrics.event("started", device=str(self.stage.device), threads=torch.get_num_threads())
        first = not self.progress.checkpoints.steps()
        if first:
            self.progress.save()
        self.role.start()
        return first

    def close(self) -> None:
        self.outbox.close()
        self.replicas.close()

    def _train_to(self, last: int) -> None:
        """A source opens steps up to `last` (as its schedule and pace allow) until all are applied."""
        self.board.target = last
        try:
            self.pump(lambda: self.step >= last)
        finally:
            self.board.target = 0  # a resume, an evaluation or the end opens nothing

    # -- what the workload's hooks call ---------------------------------------------------------------
    def evaluate(self, split: str, indices: list[int], batch_size: int) -> dict[str, Any]:
        """Inference from this source (nebula.runtime.inference); -> {sink: its scores}."""
        return self.inference.evaluate(split, indices, batch_size)

    def forget_examples(self, split: str) -> None:
        """The source's `split` changed (e.g. `nebula translate`'s next input): read its ids again."""
        self.examples.forget(split)

    # -- executing the schedule's actions ---------------------------------------------------------------
    def _work(self) -> None:
        """Everything the messages so far allow: the schedule's actions, then inference batches."""
        self.guard.withheld()  # a rank's relay may have withheld one meanwhile
        while True:
            action = self.schedule.next_action(self.board)
            if action is not None:
                self._execute(action)
                self.guard.withheld()
            elif self.inference.due():
                self.inference.run_next()
            else:
                return

    def _execute(self, action: Action) -> None:
        board, compute = self.board, self.compute
        if isinstance(action, Open):
            return board.open_step(action.step, *self.examples.of_step(action.step))
        if isinstance(action, Apply):
            return self._apply(board.open.pop(action.step))
        if isinstance(action, Skip):
            return self.guard.skip(action.step)
        if isinstance(action, Sync):
            return self.replicas.sync(action.step)
        state = board.open[action.step]
        if isinstance(action, Forward):
            compute.forward(*board.take_forward(state))
        elif isinstance(action, BackwardWeight):
            board.take_weight(state)
            compute.backward(action.step, action.index, {}, "weight")
        else:  # the input gradient goes back first where the schedule split it from the weights'
            whole = isinstance(action, Backward)
            compute.backward(action.step, action.index, board.take_gradients(state, whole), "all" if whole else "input")

    def _apply(self, state: StepState) -> None:
        tally = self.compute.apply(state.step, ahead=lambda: self.board.hand_out(state.step + 1, self.compute))
        self.progress.applied(state, tally)
        self.outbox.observe_step(tally.compute_s)
        self.outbox.paced(self.board.pace.senders, state.step)

    # -- messages ---------------------------------------------------------------------------------------
    def pump(self, until: Callable[[], bool], deadline: float | None = None) -> None:
        """Handle messages until `until()` holds (or time.monotonic() passes `deadline`)."""
        self._work()
        while not until():
            if (msg := self.inbox.recv(deadline)) is None:
                return  # the deadline passed
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        if self.replicas.owns(msg.src):
            self.replicas.receive(msg)  # another replica's instance of this stage: the outer rounds
            return self._work()
        sender = self.inbox.sender(msg, self.job.name)
        if msg.kind == Kind.CONTROL:
            topic, body = ctl.parse_control(msg)
            if topic in PROTOCOL:  # the resume protocol crosses generations
                self.role.on_protocol(sender, topic, body)
            elif self.generations.admits(msg):
                self._control(sender, topic, body, msg)
        elif msg.kind == Kind.TENSORS:
            if self.generations.admits(msg):
                self._data(sender, msg)
        elif msg.kind == Kind.ERROR:  # a tensor of this stage's refused (the inbox raises other ERRORs)
            self.metrics.event("refused-by", stage=sender, step=msg.step, reason=msg.error_message[:500])
        else:
            raise StageError(f"{msg.src} sent an unexpected {msg.kind.name} message to a stage")
        self._work()

    def _control(self, sender: str, topic: Topic, body: Any, msg: Message) -> None:
        if topic is Topic.PACE and self.board.pace.acknowledged(f"{self.name}->{sender}", body.step):
            return
        if topic is Topic.INFER_END:
            link = self.outbox.link(sender, self.name, "ended an inference pass")
            return self.inference.received(msg, link, None, None, body)
        if self.inference.on_control(sender, topic, body) or self.role.on_control(sender, topic, body):
            return
        raise StageError(f"{self.outbox.addresses[sender]} sent {topic.value!r} to {self.name}, which does not "
                         "expect it now (do all sites run the same job file?)")

    def _data(self, sender: str, msg: Message) -> None:
        topic = ctl.parse_data_topic(msg)
        if topic.kind is DataKind.BACKWARD:
            link = self.outbox.link(self.name, sender, "sent gradients", backward=True)
            self.board.check_gradients(msg.src, link.name, msg.step, msg.micro_batch)
            if (received := self.guard.receive(link, msg, sender, self.stage.device)) is not None:
                self.board.gradients(link.name, msg.step, msg.micro_batch, received[0])
            return
        link = self.outbox.link(sender, self.name, "sent tensors")
        if (received := self.guard.receive(link, msg, sender, self.stage.device, topic.kind is DataKind.INFER)) is None:
            return  # refused: its step is aborted
        inputs, ids = received
        assert ids is not None  # Link.receive refuses activations without their example ids
        if topic.kind is DataKind.INFER:
            return self.inference.received(msg, link, inputs, ids, topic)
        ahead = min(self.train.steps, self.step + self.schedule.horizon)  # how far the schedule lets a sender run
        self.board.arrived(msg.src, link.name, msg.step, msg.micro_batch, inputs, ids, ahead)

    # -- what the coordinator's protocol calls ---------------------------------------------------------
    def abandon(self) -> None:
        """Drop whatever is in flight: unsent messages, open steps, inference in progress, and from
        now on what other stages still send of this generation (they may not have heard yet)."""
        self.generations.abandon()
        self.outbox.sender.discard()
        self.board.abandon()
        self.inference.clear()
