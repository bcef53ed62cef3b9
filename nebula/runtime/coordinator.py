"""The coordinator's side of the resume protocol, as a socket-free state machine.

One stage (the job's first) coordinates. A round: it sends RESYNC(round) to every other member,
each answers HELLO with the steps of its good checkpoints (a member that just started sends one
unasked); when all have answered it picks the last step *every* member holds, bumps the generation
above every member's, loads that checkpoint itself and sends RESUME(round, step, generation); each
member loads it and answers READY(round). Messages of older generations are dropped from then on,
so nothing from an abandoned step is ever applied.

A member restarting shows as a HELLO with a new `incarnation` (random per process start): during
training, or while READYs are awaited, that starts a new round; while HELLOs are still being
collected the newcomer's HELLO simply replaces the answer of its previous incarnation.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nebula.errors import StageError
from nebula.runtime.control import Hello, Ready


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
