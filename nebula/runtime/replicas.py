"""Replicas: one stage's side of the outer rounds with the same stage of the job's other replicas.

Every replica of a job (nebula.runtime.replica_set) runs the whole stage graph with its own coordinator;
each of its stages exchanges pseudo-gradients with the same stage of the other replicas, through the
gateways (the same wire, CURVE and audit as every message: the gateway routes by site). The schedule
names the round, `Sync(t)`, after `Apply(t)` at a round's end (nebula.runtime.schedules.base); the runner
executes it here. What a round decides is nebula.runtime.exchange's, the maths nebula.runtime.outer's.

Messages (their bodies are checked dataclasses; a bad one is refused, audited and dropped):
- HELLO (control): the stage's parameters (names, shapes) and, per fragment, its state (version, chain,
  weight, anchor digest); sent to every other replica on every (re)start, answered once. A replica whose
  parameters differ is refused before training, with the first mismatching name.
- GRAD (tensors): a fragment's pseudo-gradient, flat, through the job's codec, tagged with its state.
- PART, MEAN (tensors; `exchange = "sharded"`, in place of GRAD): slice i of a pseudo-gradient to the replica
  that averages slice i; that replica's mean of it, with its contributors, to every other.
- FETCH (control) / STATE (tensors): a replica behind (restarted, cut off, or on a losing history) asks
  one that is ahead for its state of a fragment: anchor and momentum, uncompressed.

Each round and each refusal is a metrics event (the log) and a record of the stage's audit log
(`<workdir>/audit.jsonl`, hash-chained: `nebula audit verify`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash

from nebula.codecs import CodecState, pack, parse, unpack
from nebula.config import build
from nebula.errors import ConfigError, NebulaError
from nebula.runtime.exchange import Decision, Exchange, Pending
from nebula.runtime.outer import OuterOptimizer, OuterState, flatten, split_fragments
from nebula.security.audit import AuditLog
from nebula.wire import Kind, Message

if TYPE_CHECKING:  # the runner builds the handle: types only
    from nebula.runtime.compute import Compute
    from nebula.runtime.job import JobConfig
    from nebula.runtime.metrics import MetricsLog
    from nebula.runtime.outbox import Outbox
    from nebula.runtime.progress import Progress
    from nebula.runtime.stage import Stage

HELLO, FETCH, GRAD, STATE = "outer-hello", "outer-fetch", "outer-grad", "outer-state"
PART, MEAN = "outer-part", "outer-mean"


@dataclass(frozen=True, kw_only=True)
class Hello:
    replica: int
    names: tuple[str, ...]  # the stage's trainable parameters, in order
    shapes: tuple[tuple[int, ...], ...]
    versions: tuple[int, ...]  # per fragment
    chains: tuple[str, ...]
    weights: tuple[int, ...]
    digests: tuple[str, ...]  # of each fragment's anchor: replicas at version 0 must start alike
    answer: bool = False  # a reply: not answered again
    exchange: str = "all-to-all"  # how its rounds travel: every replica of a job must use the same


@dataclass(frozen=True, kw_only=True)
class Tag:
    """What a GRAD or STATE is about: the sender's state of the fragment."""

    replica: int
    fragment: int
    version: int
    chain: str
    weight: int


@dataclass(frozen=True, kw_only=True)
class Share(Tag):
    """A PART or MEAN: which slice of the fragment; a MEAN's contributors."""

    part: int
    contributors: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Fetch:
    replica: int
    fragment: int


BODIES: dict[str, type] = {HELLO: Hello, GRAD: Tag, FETCH: Fetch, STATE: Tag, PART: Share, MEAN: Share}


@dataclass(frozen=True)
class Handle:
    """What the replicas component may see and do of its stage."""

    name: str
    job: JobConfig  # the job as this replica runs it
    stage: Stage  # its trainable parameters
    outbox: Outbox  # its sender thread: in order with the stage's data
    compute: Compute  # the other ranks take the weights an outer round wrote
    progress: Progress  # the step applied; a checkpoint before each round
    metrics: MetricsLog
    pump: Callable[[Callable[[], bool], float | None], None]  # handle messages until a condition or a deadline


class Replicas:
    def __init__(self, stage: Handle):
        self.stage, job = stage, stage.job
        assert job.replicas is not None  # built only for a job with [replicas]
        self.config, self.k, self.steps = job.replicas.config, job.replica, job.train.steps
        params = stage.stage.trainable()
        self.names = list(params)
        self.shapes = tuple(tuple(p.shape) for p in params.values())
        fragments = split_fragments({n: p.numel() for n, p in params.items()}, self.config.fragments)
        self.sharded = self.config.exchange == "sharded"
        self.exchange = Exchange.of(self.k, job.replicas.peers(self.k, stage.name), params, fragments,
                                    OuterOptimizer(self.config.outer), self.sharded)
        self.by_address = {peer.address: j for j, peer in self.exchange.peers.items()}
        self.codec, self.codecs = parse(self.config.codec), CodecState()
        self.synced = 0  # the last step whose rounds ran
        self.working = False  # in a round, a join or a fetch
        self.joined = False  # since the last start or restore: until then no round may run
        self.restored = -1  # the step last restored
        self.fetching: dict[int, int] = {}  # fragment -> the replica asked for its state
        self.audit: AuditLog | None = None

    # -- what the board and the runner ask ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Not joined yet (since a start or a restore), or in a round or a fetch: the schedule names
        nothing else meanwhile (a resume's own messages are handled, its actions wait)."""
        return self.working or not self.joined

    def due(self, t: int) -> bool:
        """Whether step t (just applied) ends a round of some fragment (or the job)."""
        return t > self.synced and (bool(self._sends(t)) or bool(self._merges(t)))

    def owns(self, address: str) -> bool:
        """Whether a message from `address` is this component's (another replica's instance of the stage)."""
        return address in self.by_address

    def _sends(self, t: int) -> list[int]:
        settled = self.exchange.settled if t == self.restored else set()
        return [f for f in range(len(self.exchange.fragments)) if f not in settled
                and (t == self.steps or (t % self.config.H == self.config.sync_offset(f) and t > 0))]

    def _merges(self, t: int) -> list[int]:
        return [f for f, p in self.exchange.pending.items() if t == self.steps or t >= p.step + self.config.overlap]

    # -- joining -------------------------------------------------------------------------------------------
    def join(self, first: bool) -> None:
        """Before training (at every start and resume; nothing once joined): say hello to every other
        replica and wait for theirs (up to start_timeout_s on a first start, deadline_s after); a
        parameter list that differs stops this stage here; fetch any fragment another replica is ahead on."""
        if self.joined:
            return
        self.working = True
        try:
            peers = self.exchange.peers
            for j, peer in peers.items():
                peer.hello = False
                if not peer.refused:
                    self._send(j, HELLO, self._hello(answer=False))
            wait = self.config.start_timeout_s if first else self.config.deadline_s
            self.stage.pump(lambda: all(p.hello or p.refused for p in peers.values()), time.monotonic() + wait)
            silent = [j for j, p in peers.items() if not p.hello and not p.refused]
            for j in silent:
                peers[j].present = False
            self.stage.metrics.event("outer-join", replica=self.k, heard=sorted(j for j, p in peers.items() if p.hello),
                                     silent=silent, versions=[s.version for s in self.exchange.states])
            for f in sorted(self.exchange.behind):
                self._fetch(f)
            self.joined = True
        finally:
            self.working = False

    def _hello(self, answer: bool) -> Hello:
        states = self.exchange.states
        return Hello(replica=self.k, names=tuple(self.names), shapes=self.shapes,
                     versions=tuple(s.version for s in states), chains=tuple(s.chain for s in states),
                     weights=tuple(s.weight for s in states), digests=tuple(_digest(s.anchor) for s in states),
                     answer=answer, exchange=self.config.exchange)

    def _on_hello(self, j: int, hello: Hello) -> None:
        why = _first_difference(self.names, self.shapes, hello) or (
            f"it splits them into {len(hello.versions)} fragments, this stage into {len(self.exchange.states)}"
            if len(hello.versions) != len(self.exchange.states) else None)
        rounds = f"its exchange is {hello.exchange!r}, this stage's {self.config.exchange!r}" \
            if hello.exchange != self.config.exchange else None
        if why or rounds:
            text = f"replica {j} ({self.exchange.peers[j].address}) runs other " \
                   f"{'parameters' if why else 'rounds'} at stage {self.stage.name}: {why or rounds}"
            if not self.joined:  # before training: this stage stops, and tells the other first
                self._send(j, HELLO, self._hello(answer=True))
                raise ConfigError(f"{text}; every replica must run the same job file (the same stage graph, "
                                  "options and model)")
            self.exchange.peers[j].refused = text
            return self._refuse(j, text)
        peer = self.exchange.peers[j]
        peer.hello = True
        self.exchange.heard(j)
        for f, state in enumerate(self.exchange.states):
            self.exchange.compare(j, f, hello.versions[f], hello.chains[f], hello.weights[f],
                                  other_anchor=hello.digests[f] != _digest(state.anchor))
        if not hello.answer:
            self._send(j, HELLO, self._hello(answer=True))

    # -- a round -------------------------------------------------------------------------------------------
    def sync(self, t: int) -> None:
        """The rounds step t ends: first a checkpoint (a restart redoes the round, never the inner steps
        whose progress it sent), then the merges due, then the sends due (merged at once without overlap)."""
        self.working = True
        try:
            if self.stage.progress.saved != t:
                self.stage.progress.save()
            self.synced = t
            for f in self._merges(t):
                self._merge(f)
            for f in self._sends(t):
                self._send_round(f, t)
                if self.config.overlap == 0 or t == self.steps:
                    self._merge(f)
            if t == self.steps:
                self.stage.progress.save()  # the job's end: every replica holds the outer weights
        finally:
            self.working = False
            self.exchange.sent_before.clear()  # a restart's doubt covers only the round it restored before

    def _send_round(self, f: int, t: int) -> None:
        if f in self.exchange.behind:
            self._fetch(f)
        state, names = self.exchange.states[f], self.exchange.fragments[f]
        live = flatten(self.stage.stage.trainable(), names)
        if self.sharded:
            return self._send_parts(f, t, state.anchor - live, live)
        slot = self.codecs.slot(f"fragment-{f}", "delta")  # error feedback's residual, where the codec keeps one
        payload = pack("delta", "outer", state.anchor - live, self.codec, state=slot)
        own = unpack(payload)  # what the others decode: everyone averages the same bits
        present = self.exchange.present()
        self.exchange.pending[f] = Pending(state.version, t, time.monotonic(), own,
                                           live if self.config.overlap else None, payload.wire_bytes * len(present))
        tag = Tag(replica=self.k, fragment=f, version=state.version, chain=state.chain, weight=state.weight)
        for j in present:
            self._send(j, GRAD, tag, [payload])
        self._greet_absent()

    def _send_parts(self, f: int, t: int, delta: torch.Tensor, live: torch.Tensor) -> None:
        """A sharded round's first half: slice i of the pseudo-gradient to its owner (kept, if it is us)."""
        state, owners, own = self.exchange.states[f], self.exchange.owners(), torch.empty_like(delta)
        pending = Pending(state.version, t, time.monotonic(), own, live if self.config.overlap else None,
                          owners=owners)
        self.exchange.pending[f] = pending
        for i, (lo, hi) in enumerate(self.exchange.slices[f]):
            if hi == lo:
                continue
            slot = self.codecs.slot(f"fragment-{f}-part-{i}", "delta")
            payload = pack("delta", "outer", delta[lo:hi].contiguous(), self.codec, state=slot)
            own[lo:hi] = unpack(payload)  # what its owner decodes
            if owners[i] != self.k:
                self._send(owners[i], PART, self._share(f, i), [payload])
                pending.wire_bytes += payload.wire_bytes
        self._greet_absent()
        self._post_means(f)

    def _greet_absent(self) -> None:
        """Tell those counted absent where this replica is: two that lost each other find each other again."""
        for j in self.exchange.absent():
            self._send(j, HELLO, self._hello(answer=False))

    def _post_means(self, f: int, force: bool = False) -> None:
        """A sharded round's second half: once every present replica's part of our slices is in (or, with
        `force`, at half the deadline), their means to every present replica."""
        pending = self.exchange.pending.get(f)
        if pending is None or pending.posted or not (force or not self.exchange.awaited_parts(f)):
            return
        pending.posted = True
        for i, (mean, who) in self.exchange.mean_of(f).items():
            slot = self.codecs.slot(f"fragment-{f}-mean-{i}", "delta")
            payload = pack("delta", "outer", mean, self.codec, state=slot)
            pending.means[i] = (unpack(payload), who)  # the bits every other replica applies
            share = self._share(f, i, who)
            for j in self.exchange.present():
                self._send(j, MEAN, share, [payload])
                pending.wire_bytes += payload.wire_bytes

    def _share(self, f: int, part: int, contributors: list[int] | None = None) -> Share:
        state = self.exchange.states[f]
        return Share(replica=self.k, fragment=f, version=state.version, chain=state.chain, weight=state.weight,
                     part=part, contributors=tuple(contributors or ()))

    def _merge(self, f: int) -> None:
        pending = self.exchange.pending[f]
        started, behind = time.monotonic(), self.exchange.behind
        if self.sharded:
            self.stage.pump(lambda: not self.exchange.awaited_parts(f) or f in behind,
                            pending.started + self.config.deadline_s / 2)
            if f not in behind:
                self._post_means(f, force=True)
        waiting = self.exchange.awaited_means if self.sharded else self.exchange.awaited
        self.stage.pump(lambda: not waiting(f) or f in behind, pending.started + self.config.deadline_s)
        if f in behind:  # another replica is ahead: the round went on without us, or another way
            return self._fetch(f)
        params = self.stage.stage.trainable()
        decision = self.exchange.decide_sharded(f, params) if self.sharded else self.exchange.decide(f, params)
        self.stage.compute.broadcast_weights()
        self._record(decision, pending, time.monotonic() - started)

    def _record(self, decision: Decision, pending: Pending, waited: float) -> None:
        fields = {"stage": self.stage.name, "replica": self.k, "fragment": decision.fragment,
                  "version": decision.version, "step": pending.step, "contributors": decision.contributors,
                  "missing": decision.missing, "of": self.exchange.replica_count}
        self.stage.metrics.event("outer", echo=bool(decision.missing), **fields, wait_s=round(waited, 3),
                                 sent_bytes=pending.wire_bytes)
        self._audit().append("outer.round", **fields)

    # -- fetching another replica's state ----------------------------------------------------------------
    def _fetch(self, f: int) -> None:
        j = self.exchange.behind[f]
        self.fetching[f] = j
        self._send(j, FETCH, Fetch(replica=self.k, fragment=f))
        self.stage.pump(lambda: f not in self.fetching, time.monotonic() + self.config.deadline_s)
        if self.fetching.pop(f, None) is not None:  # no answer: it is gone; a later message says who is ahead
            self.exchange.behind.pop(f, None)
            self.stage.metrics.event("outer-fetch-failed", fragment=f, replica=j)

    def _on_state(self, j: int, tag: Tag, tensors: dict[str, torch.Tensor]) -> None:
        if self.fetching.get(tag.fragment) != j:
            return  # asked of another, or given up: nothing to take
        if self.exchange.states[tag.fragment].ahead_of(tag.version, tag.chain, tag.weight):
            del self.fetching[tag.fragment]  # it fell behind us meanwhile (restarted): keep ours
            self.exchange.behind.pop(tag.fragment, None)
            return
        momentum = tensors["momentum"].clone() if tag.version else None
        state = OuterState(tensors["anchor"].clone(), momentum, tag.version, tag.chain, tag.weight)
        self.exchange.adopt(tag.fragment, state, self.stage.stage.trainable())
        self.stage.compute.broadcast_weights()
        del self.fetching[tag.fragment]
        fields: dict[str, Any] = {"stage": self.stage.name, "replica": self.k, "fragment": tag.fragment,
                                  "version": tag.version, "from": j}
        self.stage.metrics.event("outer-fetched", **fields)
        self._audit().append("outer.fetched", **fields)

    def _state_of(self, f: int) -> tuple[Tag, list]:
        if not 0 <= f < len(self.exchange.states):
            raise _Refused(f"it asks for fragment {f}, which this stage does not have")
        state = self.exchange.states[f]
        momentum = state.momentum if state.momentum is not None else torch.zeros_like(state.anchor)
        tag = Tag(replica=self.k, fragment=f, version=state.version, chain=state.chain, weight=state.weight)
        return tag, [pack("anchor", "outer", state.anchor, "none"), pack("momentum", "outer", momentum, "none")]

    # -- messages ------------------------------------------------------------------------------------------
    def receive(self, msg: Message) -> None:
        """A message of another replica's instance of this stage: taken, or refused (audited) and dropped."""
        j = self.by_address[msg.src]
        try:
            if msg.job and msg.job != self.stage.job.name:
                raise _Refused(f"it is of job {msg.job!r}, not {self.stage.job.name!r}")
            body = self._body(msg)
            if body.replica != j:
                raise _Refused(f"it says it is replica {body.replica}, but {msg.src} is replica {j}'s")
            if isinstance(body, Hello):
                return self._on_hello(j, body)
            if isinstance(body, Fetch):
                return self._send(j, STATE, *self._state_of(body.fragment))
            if (msg.topic in (PART, MEAN) and not self.sharded) or (msg.topic == GRAD and self.sharded):
                raise _Refused(f"a {msg.topic} in a job whose exchange is {self.config.exchange!r}")
            tensors = {t.name: unpack(t) for t in msg.tensors}
            part = body.part if isinstance(body, Share) else None
            why = self.exchange.check(j, body.fragment, tensors, "anchor momentum" if msg.topic == STATE else "delta",
                                      part) or (_bad_contributors(body, j, self.exchange.replica_count)
                                                if msg.topic == MEAN else None)
            if why:
                raise _Refused(why)
            if msg.topic == STATE:
                return self._on_state(j, body, tensors)
            self._on_grad(j, body, tensors["delta"], msg.topic)
        except (_Refused, NebulaError) as exc:
            if isinstance(exc, ConfigError) and not self.joined:
                raise  # another graph, seen before training: this stage stops (exit 3)
            self._refuse(j, str(exc), msg)

    def _on_grad(self, j: int, tag: Tag, grad: torch.Tensor, topic: str) -> None:
        share, entry = None, grad  # type: tuple[str, int] | None, Any
        if isinstance(tag, Share):
            share = ("mean" if topic == MEAN else "part", tag.part)
            entry = (grad, list(tag.contributors)) if topic == MEAN else grad
        verdict = self.exchange.offer(j, tag.fragment, tag.version, tag.chain, tag.weight, entry, share)
        if verdict == "kept" and share and share[0] == "part":
            self._post_means(tag.fragment)
        if verdict in ("stale", "twice"):
            fields = {"stage": self.stage.name, "replica": self.k, "from": j, "fragment": tag.fragment,
                      "version": tag.version, "verdict": verdict}
            self.stage.metrics.event("outer-late", echo=False, **fields)
            self._audit().append("outer.late", **fields)
            if verdict == "stale":  # tell it where we are: it fetches
                self._send(j, HELLO, self._hello(answer=True))

    def _body(self, msg: Message) -> Any:
        cls = BODIES.get(msg.topic)
        expected = Kind.CONTROL if msg.topic in (HELLO, FETCH) else Kind.TENSORS
        if cls is None or msg.kind != expected:
            raise _Refused(f"a {msg.kind.name} of topic {msg.topic!r:.40}, which the outer rounds do not use")
        try:
            return build(cls, json.loads(msg.body or b"{}"), f"{msg.topic} from {msg.src}")
        except (ValueError, RecursionError) as exc:
            raise _Refused(f"the body is not JSON ({exc})") from exc

    def _refuse(self, j: int, why: str, msg: Message | None = None) -> None:
        src = msg.src if msg is not None else self.exchange.peers[j].address
        fields = {"stage": self.stage.name, "replica": self.k, "from": j, "src": src,
                  "topic": msg.topic[:40] if msg is not None else HELLO}
        print(f"[{self.stage.metrics.label}] refused an outer-round message from {src}: {why}", file=sys.stderr,
              flush=True)
        self.stage.metrics.event("outer-refused", echo=False, **fields, reason=why[:300])
        self._audit().repeated("outer.refused", fields, {}, reason=why[:300])

    def _send(self, j: int, topic: str, body: Any, tensors: list | None = None) -> None:
        kind = Kind.TENSORS if tensors is not None else Kind.CONTROL
        msg = Message(kind=kind, job=self.stage.job.name, dst=self.exchange.peers[j].address, topic=topic,
                      body=json.dumps(asdict(body)).encode(), tensors=tensors or [], step=self.stage.progress.step)
        self.stage.outbox.sender.submit(lambda: msg)

    def _audit(self) -> AuditLog:
        if self.audit is None:
            self.audit = AuditLog(self.stage.progress.workdir / "audit.jsonl")
        return self.audit

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = {f: {"version": p.version, "step": p.step, "own": p.own.clone(),
                       "sent": None if p.sent is None else p.sent.clone(), "owners": list(p.owners),
                       "means": {i: (m.clone(), list(who)) for i, (m, who) in p.means.items()}, "posted": p.posted,
                       "late": list(p.late)} for f, p in self.exchange.pending.items()}
        return {"synced": self.synced, "states": [s.state_dict() for s in self.exchange.states], "pending": pending,
                "codecs": self.codecs.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A restore: the outer state as saved; what was in flight with the others is void (join sees where
        they are)."""
        self.synced = int(saved["synced"])
        self.exchange.states = [OuterState.from_dict(s) for s in saved["states"]]
        self.exchange.pending = {int(f): Pending(p["version"], p["step"], time.monotonic(), p["own"], p["sent"],
                                                 owners=p.get("owners", []), means=p.get("means", {}),
                                                 posted=p.get("posted", False), late=p.get("late", []))
                                 for f, p in saved["pending"].items()}
        self.exchange.arrived.clear()
        self.exchange.behind.clear()
        self.fetching.clear()
        self.joined = False  # no round before the others are met again
        step, params = self.stage.progress.step, self.stage.stage.trainable()
        self.restored = step
        self.exchange.settled.clear()
        # saved just before a round's send: the incarnation that saved it may have sent it, and what it
        # sent is then in the others' state already; taking their state (join) keeps none of it again
        self.exchange.sent_before = {f: flatten(params, self.exchange.fragments[f]) for f in self._sends(step)
                                     if self.synced < step and f not in self.exchange.pending}
        self.codecs.load_state_dict(saved["codecs"])

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()


class NoReplicas:
    """A job without [replicas]: nothing to meet, no rounds, no message of another replica."""

    def join(self, first: bool) -> None:
        pass

    def owns(self, address: str) -> bool:
        return False

    def receive(self, msg: Message) -> None:
        raise AssertionError("owns() is False for every address")

    def sync(self, t: int) -> None:
        raise AssertionError("the schedule names Sync only where the board has rounds")

    def close(self) -> None:
        pass


def attach(handle: Handle, board: Any) -> Replicas | NoReplicas:
    """The stage's outer rounds (its board asks them when a round is due; its checkpoints keep their
    state), or NoReplicas for a job without [replicas]."""
    if handle.job.replicas is None:
        return NoReplicas()
    found = Replicas(handle)
    board.rounds = handle.progress.parts["replicas"] = found
    return found


def _bad_contributors(share: Share, owner: int, count: int) -> str | None:
    who = list(share.contributors)
    if who != sorted(set(who)) or owner not in who or not all(0 <= j < count for j in who):
        return f"its contributors {who[:8]} are not distinct replicas of the {count}, in order, with its sender"
    return None


class _Refused(Exception):
    """A message of another replica that is not taken: why."""


def _digest(anchor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(anchor.contiguous().numpy().tobytes())


def _first_difference(names: list[str], shapes: tuple[tuple[int, ...], ...], hello: Hello) -> str | None:
    """The first parameter in which another replica's stage differs from this one, or None."""
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if i >= len(hello.names):
            return f"it lacks parameter {name} {shape} (it has {len(hello.names)}, this stage {len(names)})"
        if hello.names[i] != name:
            return f"its parameter {i} is {hello.names[i]}, here {name}"
        if tuple(hello.shapes[i]) != shape:
            return f"parameter {name} has shape {tuple(hello.shapes[i])} there, {shape} here"
    if len(hello.names) > len(names):
        return f"it has parameter {hello.names[len(names)]} more (it has {len(hello.names)}, this stage {len(names)})"
    if len(hello.shapes) != len(hello.names) or len({len(hello.versions), len(hello.chains), len(hello.weights),
                                                      len(hello.digests)}) != 1:
        return "its hello lists do not match in length"
    return None
