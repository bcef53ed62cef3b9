"""Typed control messages between the stages of a job: an enum of topics, each with a checked body.

A CONTROL message's `topic` is a `Topic` value and its `body` the JSON of that topic's dataclass;
an unknown topic, a missing or mistyped field, or an extra one is a StageError naming the sender.
TENSORS messages say what they carry in their topic too (`DataTopic`): a training micro-batch
going forward, its gradients coming back, or an inference batch (which stage asked, which split).
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from nebula.config import build, limits
from nebula.errors import ConfigError, StageError
from nebula.wire import Kind, Message


class Topic(enum.Enum):
    HELLO = "hello"  # member -> coordinator: I (re)started, these are my checkpoints
    RESYNC = "resync"  # coordinator -> members: abandon what you are doing and say hello
    RESUME = "resume"  # coordinator -> members: load this checkpoint, this is the new generation
    READY = "ready"  # member -> coordinator: loaded
    PACE = "pace"  # receiver -> sender of a forward-only link: I applied this step (paper Figure 6)
    INFER_END = "infer-end"  # along the links: no more inference batches from `origin` for `split`
    INFER_PROGRESS = "infer-progress"  # sink -> origin: decoded n examples so far
    SCORES = "scores"  # sink -> origin: the workload's summary of an inference pass
    ENDED = "ended"  # source -> coordinator: trained to the last step and ran its hooks
    FINISH = "finish"  # coordinator -> members: save and exit once you reach `step`
    DONE = "done"  # member -> coordinator: saved, exiting
    ABORT = "abort"  # any stage -> coordinator: a tensor of this step was bad (nebula.runtime.integrity)


# a message's generation is a uint64 on the wire, and the coordinator bumps the largest it hears by one
GENERATION = limits(at_least=0, below=1 << 62, hint="a generation number")


@dataclass(frozen=True, kw_only=True)
class Hello:
    incarnation: int  # random per process start: a new one means the member restarted
    checkpoints: tuple[int, ...]  # steps of the member's good checkpoints
    generation: int = field(metadata=GENERATION)
    job: str  # the digest of the job definition it runs (nebula.runtime.job_digest)
    job_keys: dict[str, str]  # ... and its keys, to name the first that differs
    answer_to: int = 0  # the RESYNC round this answers; 0: sent on start


@dataclass(frozen=True, kw_only=True)
class Resync:
    round: int
    job: str  # the coordinator's job definition, as in Hello: a member checks it too
    job_keys: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class Resume:
    round: int
    step: int
    generation: int = field(metadata=GENERATION)
    skip: tuple[int, ...] = ()  # steps every stage moves past without applying them (a bad tensor's)


@dataclass(frozen=True, kw_only=True)
class Ready:
    round: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Pace:
    step: int


# a stage or split name from a peer: a split names files at the sink (`{split}.hyp`), so no path in it
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _names(body: Any, *fields: str) -> None:
    for name in fields:
        if not _NAME.match(getattr(body, name)):
            raise ConfigError(f"control {TOPICS[type(body)].value!r}: {name} {getattr(body, name)!r:.80} must be "
                              "1-64 letters, digits, '_', '-' or '.'")


@dataclass(frozen=True, kw_only=True)
class InferEnd:
    origin: str
    split: str

    def __post_init__(self) -> None:
        _names(self, "origin", "split")


@dataclass(frozen=True, kw_only=True)
class InferProgress:
    split: str
    n: int

    def __post_init__(self) -> None:
        _names(self, "split")


@dataclass(frozen=True, kw_only=True)
class Scores:
    split: str
    sink: str
    scores: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _names(self, "split", "sink")


@dataclass(frozen=True, kw_only=True)
class Ended:
    step: int


@dataclass(frozen=True, kw_only=True)
class Finish:
    step: int


@dataclass(frozen=True, kw_only=True)
class Done:
    step: int


@dataclass(frozen=True, kw_only=True)
class Abort:
    step: int
    reason: str  # what was bad, for the coordinator's log


BODIES: dict[Topic, type] = {Topic.HELLO: Hello, Topic.RESYNC: Resync, Topic.RESUME: Resume, Topic.READY: Ready,
                             Topic.PACE: Pace, Topic.INFER_END: InferEnd, Topic.INFER_PROGRESS: InferProgress,
                             Topic.SCORES: Scores, Topic.ENDED: Ended, Topic.FINISH: Finish, Topic.DONE: Done,
                             Topic.ABORT: Abort}
TOPICS = {type_: topic for topic, type_ in BODIES.items()}


def control(body: Any, job: str, dst: str, generation: int) -> Message:
    """A CONTROL message carrying `body` (one of the dataclasses above)."""
    return Message(kind=Kind.CONTROL, job=job, dst=dst, topic=TOPICS[type(body)].value,
                   body=json.dumps(asdict(body)).encode(), generation=generation)


def parse_control(msg: Message) -> tuple[Topic, Any]:
    """-> (topic, checked body), or StageError naming the sender and what is wrong."""
    try:
        topic = Topic(msg.topic)
    except ValueError:
        raise StageError(f"{msg.src} sent an unknown control topic {msg.topic!r}; known: "
                         f"{', '.join(t.value for t in Topic)} (do both stages run the same Nebula?)") from None
    try:
        raw = json.loads(msg.body or b"{}")
        return topic, build(BODIES[topic], raw, f"control {topic.value!r} from {msg.src}")
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested deeper than Python recurses
        raise StageError(f"control {topic.value!r} from {msg.src}: the body is not JSON ({exc})") from exc
    except ConfigError as exc:
        raise StageError(str(exc)) from exc


class DataKind(enum.Enum):
    FORWARD = "fwd"  # a training micro-batch
    BACKWARD = "bwd"  # gradients of a training micro-batch, back along a two-way link
    INFER = "infer"  # an inference batch: topic "infer:ORIGIN:SPLIT"


@dataclass(frozen=True)
class DataTopic:
    kind: DataKind
    origin: str = ""  # INFER: the stage that asked (it gets the scores)
    split: str = ""

    def __str__(self) -> str:
        return f"infer:{self.origin}:{self.split}" if self.kind is DataKind.INFER else self.kind.value


def infer_topic(origin: str, split: str) -> DataTopic:
    if not _NAME.match(split):
        raise StageError(f"split name {split!r}: use 1-64 letters, digits, '_', '-' or '.'")
    return DataTopic(DataKind.INFER, origin, split)


def parse_data_topic(msg: Message) -> DataTopic:
    kind, _, rest = msg.topic.partition(":")
    try:
        data_kind = DataKind(kind)
    except ValueError:
        raise StageError(f"{msg.src} sent tensors with an unknown topic {msg.topic!r}: expected fwd, bwd or "
                         "infer:ORIGIN:SPLIT") from None
    if data_kind is not DataKind.INFER:
        if rest:
            raise StageError(f"{msg.src} sent tensors with topic {msg.topic!r}: {kind} takes no arguments")
        return DataTopic(data_kind)
    origin, _, split = rest.partition(":")
    if not (_NAME.match(origin) and _NAME.match(split)):
        raise StageError(f"{msg.src} sent tensors with topic {msg.topic!r}: expected infer:ORIGIN:SPLIT")
    return DataTopic(data_kind, origin, split)
