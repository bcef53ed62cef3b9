"""The resume protocol as a stage runner takes part in it (the coordinator's decisions themselves are
nebula.runtime.coordinator): rounds of RESYNC / HELLO / RESUME / READY, generations, and what a
stage drops or keeps when it abandons work in flight.

A member (re)starting, or the coordinator asking, raises `Resync` out of whatever the stage was
doing; the runner's lifecycle catches it and calls `_recover`, which brings the stage back into a
new generation at a checkpoint every stage holds.
"""
from __future__ import annotations

import random
from typing import Any

from nebula.errors import StageError
from nebula.runtime import control as ctl
from nebula.runtime.control import Topic
from nebula.runtime.coordinator import Coordination
from nebula.wire import Message


class Resync(Exception):
    """Abandon the work in flight: a member restarted, or the coordinator asked (round)."""

    def __init__(self, round_: int = 0):
        super().__init__("resynchronising")
        self.round = round_


class ResumeProtocol:
    """Mixed into StageRunner (which holds `step`, `generation`, the sender and the checkpoints)."""

    def init_resume(self) -> None:
        self.members = [s for s in self.graph.stages if s != self.name]
        self.is_coordinator = self.name == self.graph.coordinator
        self.coordination = Coordination(list(self.members)) if self.is_coordinator else None
        self.incarnation = random.SystemRandom().randrange(1, 1 << 62)  # a new one per process start
        self.joining: int | None = None  # member: the RESYNC round answered last, while awaiting RESUME
        self.later: list[Message] = []  # newer-generation messages, until this stage resumes into it
        self.later_bytes = 0  # their bodies' and tensors' bytes, bounded (runner.LATER_BYTES)
        self.floor = 0  # messages of generations below it belong to abandoned work

    def _protocol(self, sender: str, topic: Topic, body: Any) -> None:
        if self.is_coordinator and topic is Topic.HELLO:
            if self.finishing:
                self._late_joiner(sender, body)
            elif self.coordination.on_hello(sender, body):
                raise Resync()
        elif self.is_coordinator and topic is Topic.READY:
            self.coordination.on_ready(sender, body)
        elif not self.is_coordinator and sender == self.graph.coordinator and topic is Topic.RESYNC:
            if self.joining is None:
                raise Resync(body.round)
            self.joining = body.round  # a new round began while we waited: answer it too
            self._tell(sender, self._hello(body.round))
        elif not self.is_coordinator and sender == self.graph.coordinator and topic is Topic.RESUME:
            if self.joining is not None and body.round >= self.joining:
                self._resume(body)
        else:
            raise StageError(f"{self.addresses[sender]} sent {topic.value!r} to {self.name}, which "
                             f"{'coordinates' if self.is_coordinator else 'is coordinated by ' + self.graph.coordinator}")

    def _coordinate(self) -> None:
        while True:
            try:
                return self._round()
            except Resync:
                continue  # a member restarted meanwhile: start over

    def _round(self) -> None:
        self._abandon()
        round_ = self.coordination.start_round()
        for member in self.members:
            self._tell(member, ctl.Resync(round=round_))
        self.pump(self.coordination.all_answered)
        step, generation = self.coordination.decide(self._hello(0))
        self.restore(step)
        self.generation = generation
        for member in self.members:
            self._tell(member, ctl.Resume(round=round_, step=step, generation=generation))
        self._replay()
        self.pump(self.coordination.all_ready)
        self.coordination.resumed()
        self.metrics.event("resumed", step=step, generation=generation)

    def _join(self, round_: int) -> None:
        """A member: answer the coordinator and wait for its RESUME (round 0: unasked, on start)."""
        self._abandon()
        self.joining = round_
        self._tell(self.graph.coordinator, self._hello(round_))
        self.pump(lambda: self.joining is None)

    def _resume(self, body: ctl.Resume) -> None:
        if body.generation < self.floor:  # the coordinator's decide() never gives one
            raise StageError(f"{self.addresses[self.graph.coordinator]} resumed {self.name} into generation "
                             f"{body.generation}, below {self.floor}, the first it has not abandoned: it would "
                             "drop every message of it as abandoned work")
        self.restore(body.step)
        self.generation, self.joining = body.generation, None
        self._tell(self.graph.coordinator, ctl.Ready(round=body.round, step=body.step))
        self.metrics.event("resumed", step=body.step, generation=body.generation)
        self._replay()

    def _recover(self, resync: Resync) -> None:
        if self.is_coordinator:
            self._coordinate()
        else:
            self._join(resync.round)

    def _late_joiner(self, sender: str, hello: ctl.Hello) -> None:
        """A member restarted after the job's end was announced: resume it at the end and finish it,
        or, if it died before saving the final step, roll every stage back as during training."""
        if self.coordination.incarnations.get(sender) == hello.incarnation:
            return
        self.coordination.incarnations[sender] = hello.incarnation
        if self.finish_at in hello.checkpoints:
            self._tell(sender, ctl.Resume(round=self.coordination.round, step=self.finish_at,
                                          generation=self.generation))
            self._tell(sender, ctl.Finish(step=self.finish_at))
            return
        exited = sorted(self.done - {sender})
        if exited:  # they saved the end and are gone: nobody can replay the steps it lacks with it
            raise StageError(f"{sender} restarted after the job ended without its final checkpoint (step "
                             f"{self.finish_at}; it has {list(hello.checkpoints)}), and {', '.join(exited)} "
                             "already finished; start every stage again to resume from a common checkpoint")
        self.finishing, self.finish_at = False, None  # the end is announced again once it is reached
        self.ended.clear()
        raise Resync()

    def _hello(self, answer_to: int) -> ctl.Hello:
        return ctl.Hello(incarnation=self.incarnation, checkpoints=tuple(self.good_checkpoints()),
                         generation=self.generation, answer_to=answer_to)

    def _abandon(self) -> None:
        """Drop whatever is in flight: unsent messages, open steps, inference in progress, and from
        now on what other stages still send of this generation (they may not have heard yet)."""
        self.floor = self.generation + 1
        self.sender.discard()
        self.open.clear()
        self.inference.clear()
        self.results.clear()
        self.ends.clear()
        self.asked.clear()

    def _replay(self) -> None:
        """Handle what arrived early for the generation just entered."""
        while True:
            ready = [m for m in self.later if m.generation <= self.generation]
            if not ready:
                return
            self._set_later([m for m in self.later if m.generation > self.generation])
            for i, msg in enumerate(ready):
                try:
                    self.handle(msg)
                except BaseException:
                    self._set_later(ready[i + 1:] + self.later)  # keep what is not handled yet
                    raise

    def _set_later(self, kept: list[Message]) -> None:
        self.later, self.later_bytes = kept, sum(held_bytes(m) for m in kept)


def held_bytes(msg: Message) -> int:
    """What a message kept for a later generation holds: its body and its tensors' frames."""
    return len(msg.body) + msg.payload_bytes
