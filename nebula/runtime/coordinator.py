"""The coordinator: resuming every stage from one checkpoint, and ending the job together.

One stage (the job's first) coordinates; every other is a member. A round: the coordinator sends
RESYNC(round) to every member, each answers HELLO with the steps of its good checkpoints (a member
that just started sends one unasked); when all have answered it picks the last step *every* member
holds, bumps the generation above every member's, loads that checkpoint itself and sends
RESUME(round, step, generation); each member loads it and answers READY(round). Messages of older
generations are dropped from then on (nebula.runtime.generations), so nothing from an abandoned step
is ever applied.

A member restarting shows as a HELLO with a new `incarnation` (random per process start): during
training, or while READYs are awaited, that starts a new round; while HELLOs are still being
collected the newcomer's HELLO simply replaces the answer of its previous incarnation.

The end: each source, through training and its hooks, says ENDED; once all have, the coordinator
sends FINISH(step) to every member, which saves that step, says DONE and exits. A member restarted
after FINISH went out is resumed at the end, or, if it lacks the final checkpoint, every stage rolls
back as during training.

`Coordination` is the coordinator's decisions as a socket-free state machine; `Coordinator` and
`Member` are the two roles a stage holds (`Role.of`), which act on their stage through a `Handle`: what
the protocol may see and do of it, nothing else.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from nebula.errors import StageError
from nebula.runtime import control as ctl
from nebula.runtime.aborts import Aborts
from nebula.runtime.control import Hello, Ready, Topic
from nebula.runtime.generations import Generations, Resync
from nebula.runtime.graph import Graph
from nebula.runtime.job_digest import JobDefinition
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.outbox import Outbox
from nebula.runtime.progress import Progress

PROTOCOL = (Topic.HELLO, Topic.RESYNC, Topic.RESUME, Topic.READY)  # handled in any generation


class Phase(enum.Enum):
    TRAINING = "training"
    HELLOS = "collecting hellos"
    READIES = "collecting readies"


@dataclass
class Coordination:
    members: list[str]  # every stage but the coordinator
    round: int = 0
    phase: Phase = Phase.TRAINING
    answers: dict[str, Hello] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    ready: set[str] = field(default_factory=set)

    def start_round(self) -> int:
        self.round += 1
        self.phase, self.answers, self.ready = Phase.HELLOS, {}, set()
        return self.round

    def on_hello(self, member: str, hello: Hello) -> bool:
        """Record `member`'s HELLO; True when it restarted and a new round must begin."""
        restarted = self.incarnations.get(member) != hello.incarnation
        self.incarnations[member] = hello.incarnation
        if self.phase is Phase.HELLOS:
            if hello.answer_to == self.round or (hello.answer_to == 0 and (restarted or member not in self.answers)):
                self.answers[member] = hello
            return False
        return restarted  # a duplicate or late answer of the same process is old news

    def all_answered(self) -> bool:
        return self.phase is Phase.HELLOS and set(self.answers) >= set(self.members)

    def decide(self, own: Hello) -> tuple[int, int]:
        """-> (the step every member resumes from, the new generation)."""
        held = {"(coordinator)": set(own.checkpoints), **{m: set(h.checkpoints) for m, h in self.answers.items()}}
        common = set.intersection(*held.values())
        if not common:
            listing = "; ".join(f"{m}: {sorted(steps) or 'none'}" for m, steps in held.items())
            raise StageError(f"no checkpoint step is held by every stage ({listing}); start every stage "
                             "from an empty workdir, or restore a common checkpoint")
        generation = max([own.generation, *(h.generation for h in self.answers.values())]) + 1
        self.phase = Phase.READIES
        return max(common), generation

    def on_ready(self, member: str, ready: Ready) -> None:
        if self.phase is Phase.READIES and ready.round == self.round:
            self.ready.add(member)

    def all_ready(self) -> bool:
        return self.phase is Phase.READIES and self.ready >= set(self.members)

    def resumed(self) -> None:
        self.phase = Phase.TRAINING


@dataclass(frozen=True)
class Handle:
    """What a stage's role may see and do of its stage."""

    name: str
    graph: Graph
    progress: Progress  # the step applied, the checkpoints held, restore
    outbox: Outbox  # tell
    generations: Generations
    metrics: MetricsLog
    pump: Callable[[Callable[[], bool]], None]  # handle messages until the condition holds
    abandon: Callable[[], None]  # drop the work in flight (a resume begins)
    replay: Callable[[], None]  # handle what arrived early for the generation just entered

    @property
    def is_source(self) -> bool:
        return not self.graph.in_links[self.name]


class Role:
    """A stage's part in resuming and ending the job."""

    def __init__(self, stage: Handle):
        self.stage = stage
        self.coordinator = stage.graph.coordinator
        self.members = [s for s in stage.graph.stages if s != stage.name]
        self.incarnation = random.SystemRandom().randrange(1, 1 << 62)  # a new one per process start
        self.definition = JobDefinition.of(stage.progress.job)  # announced in HELLO and RESYNC, checked in both
        self.asked: set[int] = set()  # steps this stage asked to abort in the generation it is in

    @staticmethod
    def of(handle: Handle) -> Role:
        return Coordinator(handle) if handle.name == handle.graph.coordinator else Member(handle)

    def start(self) -> None:
        """Agree with every other stage on the last checkpoint they all hold, and load it."""
        self.recover(Resync())

    def recover(self, resync: Resync) -> None:
        raise NotImplementedError

    def on_protocol(self, sender: str, topic: Topic, body: Any) -> None:
        raise NotImplementedError

    def on_control(self, sender: str, topic: Topic, body: Any) -> bool:
        """ENDED, FINISH, DONE; False if this role does not take `topic` from `sender`."""
        raise NotImplementedError

    def end(self, target: int) -> None:
        """Through training: wait until the whole job has reached step `target`."""
        raise NotImplementedError

    def abort(self, step: int, reason: str) -> None:
        """A tensor of `step` was bad here: the coordinator aborts the step (nebula.runtime.aborts)."""
        if step not in self.asked:
            self.asked.add(step)
            self.stage.outbox.tell(self.coordinator, ctl.Abort(step=step, reason=reason[:500]))

    def final(self) -> None:
        """Saved the end: say so."""

    def awaited_resume(self) -> list[str] | None:
        """The stages whose messages a resume in progress waits for, or None."""
        raise NotImplementedError

    def awaited_end(self) -> list[str] | None:
        """The stages whose messages the end of the job waits for, or None."""
        raise NotImplementedError

    def hello(self, answer_to: int) -> ctl.Hello:
        stage = self.stage
        return ctl.Hello(incarnation=self.incarnation, checkpoints=tuple(stage.progress.good_checkpoints()),
                         generation=stage.generations.current, answer_to=answer_to,
                         job=self.definition.digest, job_keys=self.definition.keys)

    def refuse(self, sender: str, topic: Topic) -> StageError:
        role = "coordinates" if isinstance(self, Coordinator) else f"is coordinated by {self.coordinator}"
        return StageError(f"{self.stage.outbox.addresses[sender]} sent {topic.value!r} to {self.stage.name}, "
                          f"which {role}")


class Coordinator(Role):
    def __init__(self, stage: Handle):
        super().__init__(stage)
        self.coordination = Coordination(list(self.members))
        self.ended: set[str] = set()  # sources through training
        self.done: set[str] = set()  # members that saved and exit
        self.finish_at: int | None = None  # the step FINISH named (None: not announced)
        self.aborts = Aborts(stage.progress.job.integrity)  # the steps a bad tensor aborted: skipped or retried

    def recover(self, resync: Resync) -> None:
        while True:
            try:
                return self._round()
            except Resync:
                continue  # a member restarted meanwhile: start over

    def _round(self) -> None:
        stage, coordination = self.stage, self.coordination
        stage.abandon()
        round_ = coordination.start_round()
        for member in self.members:
            stage.outbox.tell(member, ctl.Resync(round=round_, job=self.definition.digest,
                                                 job_keys=self.definition.keys))
        stage.pump(coordination.all_answered)
        step, generation = coordination.decide(self.hello(0))
        stage.progress.restore(step)
        stage.generations.enter(generation)
        for member in self.members:
            stage.outbox.tell(member, ctl.Resume(round=round_, step=step, generation=generation, skip=self.aborts.skip))
        stage.progress.board.skipping, self.asked = frozenset(self.aborts.skips), set()
        stage.replay()
        stage.pump(coordination.all_ready)
        coordination.resumed()
        stage.metrics.event("resumed", step=step, generation=generation)

    def on_protocol(self, sender: str, topic: Topic, body: Any) -> None:
        if topic is Topic.HELLO:
            self.definition.check(f"{sender} ({self.stage.outbox.addresses[sender]})", body.job, body.job_keys)
            if self.finish_at is not None:
                self._late_joiner(sender, body)
            elif self.coordination.on_hello(sender, body):
                raise Resync()
        elif topic is Topic.READY:
            self.coordination.on_ready(sender, body)
        else:
            raise self.refuse(sender, topic)

    def on_control(self, sender: str, topic: Topic, body: Any) -> bool:
        if topic is Topic.ENDED:
            self.ended.add(sender)
        elif topic is Topic.DONE:
            self.done.add(sender)
        elif topic is Topic.ABORT:
            self._abort(sender, body.step, body.reason)
        else:
            return False
        return True

    def abort(self, step: int, reason: str) -> None:
        self._abort(self.stage.name, step, reason)

    def _abort(self, stage: str, step: int, reason: str) -> None:
        """Skip or retry `step` (the job's [integrity] on_bad), then resume every stage before it."""
        outcome = self.aborts.decide(step)
        self.stage.metrics.event("aborted", step=step, by=stage, outcome=outcome, reason=reason)
        raise Resync()

    def end(self, target: int) -> None:
        stage = self.stage
        if stage.is_source:
            self.ended.add(stage.name)
        stage.pump(lambda: self.ended >= set(stage.graph.sources))
        self.finish_at = target
        for member in self.members:
            stage.outbox.tell(member, ctl.Finish(step=target))
        stage.pump(lambda: stage.progress.step >= target and self.done >= set(self.members))

    def awaited_resume(self) -> list[str] | None:
        coordination = self.coordination
        if coordination.phase is Phase.TRAINING:
            return None
        got = coordination.answers if coordination.phase is Phase.HELLOS else coordination.ready
        return [m for m in self.members if m not in got]

    def awaited_end(self) -> list[str] | None:
        if self.stage.progress.step < self.stage.progress.train.steps:
            return None
        if self.finish_at is not None:
            return [m for m in self.members if m not in self.done]
        return [s for s in self.stage.graph.sources if s not in self.ended]

    def _late_joiner(self, sender: str, hello: ctl.Hello) -> None:
        """A member restarted after the job's end was announced: resume it at the end and finish it,
        or, if it died before saving the final step, roll every stage back as during training."""
        coordination, stage = self.coordination, self.stage
        if coordination.incarnations.get(sender) == hello.incarnation:
            return
        coordination.incarnations[sender] = hello.incarnation
        if self.finish_at in hello.checkpoints:
            stage.outbox.tell(sender, ctl.Resume(round=coordination.round, step=self.finish_at, skip=self.aborts.skip,
                                           generation=stage.generations.current))
            stage.outbox.tell(sender, ctl.Finish(step=self.finish_at))
            return
        exited = sorted(self.done - {sender})
        if exited:  # they saved the end and are gone: nobody can replay the steps it lacks with it
            raise StageError(f"{sender} restarted after the job ended without its final checkpoint (step "
                             f"{self.finish_at}; it has {list(hello.checkpoints)}), and {', '.join(exited)} "
                             "already finished; start every stage again to resume from a common checkpoint")
        self.finish_at = None  # the end is announced again once it is reached
        self.ended.clear()
        raise Resync()


class Member(Role):
    def __init__(self, stage: Handle):
        super().__init__(stage)
        self.joining: int | None = None  # the RESYNC round answered last, while awaiting RESUME
        self.finish_at: int | None = None  # the step FINISH asked this stage to reach

    def recover(self, resync: Resync) -> None:
        """Answer the coordinator and wait for its RESUME (round 0: unasked, on start)."""
        stage = self.stage
        stage.abandon()
        self.joining = resync.round
        stage.outbox.tell(self.coordinator, self.hello(resync.round))
        stage.pump(lambda: self.joining is None)

    def on_protocol(self, sender: str, topic: Topic, body: Any) -> None:
        if sender == self.coordinator and topic is Topic.RESYNC:
            self.definition.check(f"{sender} ({self.stage.outbox.addresses[sender]})", body.job, body.job_keys)
            if self.joining is None:
                raise Resync(body.round)
            self.joining = body.round  # a new round began while we waited: answer it too
            self.stage.outbox.tell(sender, self.hello(body.round))
        elif sender == self.coordinator and topic is Topic.RESUME:
            if self.joining is not None and body.round >= self.joining:
                self._resume(body)
        else:
            raise self.refuse(sender, topic)

    def _resume(self, body: ctl.Resume) -> None:
        stage = self.stage
        if body.generation < stage.generations.floor:  # the coordinator's decide() never gives one
            raise StageError(f"{stage.outbox.addresses[self.coordinator]} resumed {stage.name} into generation "
                             f"{body.generation}, below {stage.generations.floor}, the first it has not "
                             "abandoned: it would drop every message of it as abandoned work")
        stage.progress.restore(body.step)
        stage.progress.board.skipping, self.asked = frozenset(body.skip), set()
        stage.generations.enter(body.generation)
        self.joining = None
        stage.outbox.tell(self.coordinator, ctl.Ready(round=body.round, step=body.step))
        stage.metrics.event("resumed", step=body.step, generation=body.generation)
        stage.replay()

    def on_control(self, sender: str, topic: Topic, body: Any) -> bool:
        if topic is Topic.FINISH and sender == self.coordinator:
            self.finish_at = body.step
            return True
        return False

    def end(self, target: int) -> None:
        stage = self.stage
        if stage.is_source:
            stage.outbox.tell(self.coordinator, ctl.Ended(step=stage.progress.step))
        stage.pump(lambda: self.finish_at is not None and stage.progress.step >= self.finish_at)

    def final(self) -> None:
        self.stage.outbox.tell(self.coordinator, ctl.Done(step=self.stage.progress.step))

    def awaited_resume(self) -> list[str] | None:
        return [self.coordinator] if self.joining is not None else None  # its RESUME

    def awaited_end(self) -> list[str] | None:
        stage = self.stage
        return [self.coordinator] if stage.progress.step >= (self.finish_at or stage.progress.train.steps) else None
