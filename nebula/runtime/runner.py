"""The runtime of one stage: a message pump. Messages in, micro-batches through the executor, messages out.

Every stage runs the same loop: `pump(until)` receives a message, `handle`s it (data goes to its
link, control to whichever component takes its topic), then `_work`s: it forwards the micro-batches
it has, in a fixed order, backwards those whose gradients came back, and applies a step once all
its micro-batches are done. A source opens steps (its examples, from the example order) as the
schedule allows. What it consults, one object each:

- the schedule (nebula.runtime.schedules): which steps may be open, at which weights they run, and
  the pace credit of forward-only links (`Pace`);
- its links (nebula.runtime.link): encode and send, receive and check against the ports;
- the executor (nebula.runtime.executor): the maths of one micro-batch, and the optimiser step;
- its role in the coordinator's protocol (nebula.runtime.coordinator): resuming every stage from a
  checkpoint all hold, and ending the job together;
- generations (nebula.runtime.generations): whether a message belongs to the work in progress;
- inference passes (nebula.runtime.inference).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from nebula.errors import DataError, LinkDown, RecvTimeout, RemoteError, StageError, TransportError
from nebula.runtime import control as ctl
from nebula.runtime.checkpoint import (
    CheckpointDir,
    checkpoints_to_keep,
    mark_finished,
    rng_state,
    set_rng_state,
)
from nebula.runtime.compression import LinkMeter
from nebula.runtime.control import DataKind, DataTopic, Topic
from nebula.runtime.coordinator import PROTOCOL, Role
from nebula.runtime.executor import Executor
from nebula.runtime.generations import Generations, Resync
from nebula.runtime.graph import Item, LinkConfig
from nebula.runtime.inference import Inference
from nebula.runtime.job import JobConfig
from nebula.runtime.link import Link
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.order import ExampleOrder, digest, id_hashes
from nebula.runtime.ranks import RankGroup
from nebula.runtime.schedules import Pace
from nebula.runtime.sender import BackgroundSender
from nebula.runtime.stage import Batch, Stage
from nebula.transport.base import Channel
from nebula.wire import Kind, Message

WAIT_NOTICE_S = 10.0  # a stage that has received nothing for this long says whom it waits for, and again as often
RANK_CHECK_S = 0.5  # a stage with ranks looks this often whether one of them failed


@dataclass
class StepState:
    """A step this stage has started: what arrived, what ran."""

    step: int
    started: float = field(default_factory=time.perf_counter)
    arrived: dict[int, tuple[Batch, dict]] = field(default_factory=dict)  # item index -> its inputs
    forwarded: int = 0  # items forwarded, in canonical order
    grads: dict[int, dict[str, dict]] = field(default_factory=dict)  # item -> out-link -> gradients
    backwarded: int = 0
    ids: list[int] = field(default_factory=list)  # example-id hashes, for the ledger


class StageRunner:
    def __init__(self, job: JobConfig, name: str, stage: Stage, channel: Channel, workdir: Path,
                 metrics: MetricsLog, ranks: RankGroup | None = None, timeout: float = 300.0):
        self.job, self.name, self.stage, self.channel = job, name, stage, channel
        self.graph, self.train, self.schedule = job.graph, job.train, job.schedule
        self.workdir, self.metrics, self.ranks, self.timeout = Path(workdir), metrics, ranks, timeout
        self.addresses = {n: s.address for n, s in job.stages.items()}
        self.names = {a: n for n, a in self.addresses.items()}
        self.sender = BackgroundSender(channel, timeout)
        self.links = self._open_links()
        self.in_links = [self.links[link.name] for link in self.graph.in_links[name]]
        self.out_links = [self.links[link.name] for link in self.graph.out_links[name]]
        self.items = self.graph.items(name)
        self.item_of = {(i.link.name if i.link else None, i.micro_batch): i for i in self.items}
        self.waits = self.graph.waits_for_gradients(name)
        self.two_way_out = sum(link.backward for link in self.out_links)  # gradients awaited per micro-batch
        self.pace = Pace(self.schedule.credit, self.graph.in_links[name], self.graph.out_links[name])
        self.executor = Executor.for_job(job, name, stage, self._emit, reduce=ranks.reduce if ranks else None)
        if ranks is not None:
            ranks.attach(self._emit, self.executor)
        self.checkpoints = CheckpointDir(self.workdir / "checkpoints", checkpoints_to_keep(
            len(self.graph.stages), self.schedule.horizon, self.train.checkpoint_every))
        self.step = 0  # the last step applied
        self.ledger: list[list[Any]] = []  # [step, digest of its example ids] per applied step
        self.open: dict[int, StepState] = {}  # steps started and not applied yet
        self.last_update: float | None = None
        self.generations = Generations(name)
        self.role = Role.of(self)
        self.inference = Inference(self)
        self._hashes: dict[str, torch.Tensor] = {}  # split -> example-id hashes (sources)
        self._order: ExampleOrder | None = None

    def _open_links(self) -> dict[str, Link]:
        meter = LinkMeter(self.workdir / "link.jsonl")
        inputs, outputs = type(self.stage).ports(self.job, self.name)
        ports = {"in": {p.name: p for p in inputs}, "out": {p.name: p for p in outputs}}
        on_switch = lambda **event: self.metrics.event("compression", **event)  # noqa: E731 - `auto` changed rung
        return {config.name: Link.open(config, self.name, self.job, ports["out" if config.src == self.name else "in"],
                                       self.sender, self.channel, meter, self.workdir, on_switch)
                for config in (*self.graph.in_links[self.name], *self.graph.out_links[self.name])}

    # -- lifecycle ---------------------------------------------------------------------------------
    def run(self, hook: Callable[[StageRunner], Any] | None = None, train: bool = True) -> Any:
        """Start, train to [train].steps (a source drives it), run `hook` (default: the stage's
        after_training, at sources), and end the job together with the other stages."""
        try:
            self.start()
            result, hooked_at = None, None
            while True:
                try:
                    if train and self.is_source:
                        self._train_to(self.train.steps)
                    if hook is not None or (train and self.is_source):
                        if hooked_at != self.step:  # once per final state (again only after a roll-back)
                            if hook is not None:
                                result = hook(self)
                            else:
                                self.stage.after_training(self)
                            hooked_at = self.step
                    self.role.end(self.train.steps if train else self.step)
                    break
                except Resync as resync:
                    self.role.recover(resync)
            self._final()
            if train:
                mark_finished(self.workdir, self.train.steps)
            return result
        except LinkDown as exc:  # another site stayed unreachable: say where the job resumes from
            raise LinkDown(f"{exc}; the job stops. Once the link is back, start its stages again: they resume "
                           f"from the newest checkpoint every stage holds ({self.name}'s newest: "
                           f"{self.checkpoints.file(max(self.good_checkpoints(), default=0))})") from exc
        except (TransportError, RemoteError):
            raise  # the link or a peer failed: there is nothing to tell the others
        except Exception as exc:  # not KeyboardInterrupt & co: an interrupted stage is restarted, not blamed
            self.report(exc)
            raise

    @property
    def is_source(self) -> bool:
        return not self.in_links

    def start(self) -> None:
        """Agree with every other stage on the last checkpoint they all hold, and load it."""
        # where it computes, first in its log: `device = "auto"` picks cuda when there is one
        self.metrics.event("started", device=str(self.stage.device), threads=torch.get_num_threads())
        if not self.checkpoints.steps():
            self.save()
        self.role.start()

    def close(self) -> None:
        self.sender.close()

    def _final(self) -> None:
        if self.step not in self.checkpoints.steps():
            self.save()
        (self.workdir / "ledger.json").write_text(json.dumps({"steps": self.ledger}))
        self.role.final()
        self.sender.flush()

    # -- what the workload's hooks call ---------------------------------------------------------------
    def evaluate(self, split: str, indices: list[int], batch_size: int) -> dict[str, Any]:
        """Inference from this source (nebula.runtime.inference); -> {sink: its scores}."""
        return self.inference.evaluate(split, indices, batch_size)

    def forget_examples(self, split: str) -> None:
        """The source's `split` changed (e.g. `nebula translate`'s next input): read its ids again."""
        self._hashes.pop(split, None)

    def example_hashes(self, split: str) -> torch.Tensor:
        if split not in self._hashes:
            self._hashes[split] = id_hashes(self.stage.examples(split))
        return self._hashes[split]

    # -- training ------------------------------------------------------------------------------------
    def _train_to(self, last: int) -> None:
        while self.step < last:
            self._train_step(self.step + 1)

    def _train_step(self, t: int) -> None:
        """Open the steps the schedule keeps open, then handle messages until step t is applied."""
        for step in self.schedule.opens(self.step, self.waits, self.train):
            if step not in self.open:
                self._open(step)
        self.pump(lambda: self.step >= t)

    def _open(self, t: int) -> None:
        """A source opens step t: its micro-batches, once every forward-only receiver allows it."""
        self.pump(lambda: self.pace.allows(t))
        hashes = self.example_hashes("train")
        if self._order is None:
            if not len(hashes):
                raise DataError(f"stage {self.name} has no training examples: check its data ({self.job.data})")
            self._order = ExampleOrder(len(hashes), self.train.batch_size, self.train.seed)
        indices, state = self._order.indices(t), self.open.setdefault(t, StepState(t))
        for item in self.items:
            chosen = indices[item.index::len(self.items)]
            state.arrived[item.index] = (Batch("train", t, item.index, ids=hashes[chosen], indices=chosen), {})

    def _work(self) -> None:
        """Do everything the messages so far allow, in the canonical order."""
        while self._work_once():
            pass

    def _work_once(self) -> bool:
        for t in sorted(self.open):
            state = self.open[t]
            if not self.executor.ready_for(t):
                break
            if state.forwarded < len(self.items) and state.forwarded in state.arrived:
                self._forward_next(state)
                return True
        for t in sorted(self.open):
            state = self.open[t]
            if self.waits and state.backwarded < state.forwarded and self._has_grads(state, state.backwarded):
                grads = state.grads.pop(state.backwarded)
                if self.ranks is not None:
                    self.ranks.backward(t, state.backwarded, grads, self.generations.current)
                else:
                    self.executor.backward(t, state.backwarded, grads)
                state.backwarded += 1
                return True
        due = self.open.get(self.step + 1)
        if due is not None and due.forwarded == len(self.items) \
                and (not self.waits or due.backwarded == len(self.items)):
            self._apply(self.open.pop(self.step + 1))
            return True
        if self.inference.due():
            self.inference.run_next()
            return True
        return False

    def _forward_next(self, state: StepState) -> None:
        """Forward the next micro-batch of `state` (it has arrived)."""
        batch, inputs = state.arrived.pop(state.forwarded)
        state.ids += batch.ids.tolist()
        self._forward(batch, inputs, self.items[state.forwarded])
        state.forwarded += 1

    def _forward(self, batch: Batch, inputs: dict, item: Item) -> None:
        if self.ranks is not None:
            self.ranks.forward(batch, inputs, item, self.generations.current)
        else:
            self.executor.forward(batch, inputs, item)

    def _forward_ahead(self, t: int) -> None:
        """With ranks, while step t - 1 is applied: hand out step t's micro-batches that have arrived and
        that other ranks compute, before the all-reduce rather than after it. A rank reads its messages in
        order, so it runs them after applying t - 1, at the weights it would have anyway; rank 0's share
        waits for the apply. Handed out one by one after the apply, the n - 1 ranks started their
        micro-batches ~55 ms apart in all at n = 8 on one core (Table 4), and the step waits for the last."""
        assert self.ranks is not None
        state = self.open.get(t)
        while state is not None and state.forwarded < len(self.items) and state.forwarded in state.arrived \
                and self.ranks.owner(self.items[state.forwarded].index) != 0:
            self._forward_next(state)

    def _has_grads(self, state: StepState, index: int) -> bool:
        return len(state.grads.get(index, {})) == self.two_way_out

    def _apply(self, state: StepState) -> None:
        if self.ranks is not None:
            tally = self.ranks.apply(state.step, ahead=lambda: self._forward_ahead(state.step + 1))
        else:
            tally = self.executor.apply(state.step)
        now, t = time.perf_counter(), state.step
        since = state.started if self.last_update is None else self.last_update  # update to update
        self.step, self.last_update = t, now
        self.ledger.append([t, digest(state.ids)])
        if tally.stats.get("tokens"):  # bytes_per_token below: this step's messages, all encoded, none of the next
            self.sender.settle()
        # wire bytes the sender thread has encoded since the last record (link.jsonl has them by step)
        sent = {key: n for link in self.links.values() for key, n in link.take_bytes().items()}
        extra: dict[str, Any] = {} if tally.loss is None else {"loss": tally.loss}
        if tally.stats:
            extra["stats"] = tally.stats
            if tally.stats.get("tokens"):  # what one token of this stage's data costs on each link
                extra["bytes_per_token"] = {k: round(n / tally.stats["tokens"], 4) for k, n in sent.items()}
        self.metrics.step(step=t, step_s=now - since, compute_s=tally.compute_s, **extra, sent=sent)
        # saved after the step's record: a kill in between runs the step again (two records, the last
        # counts), where saving first could leave an applied step with no record at all
        if self.train.saves_after(t):
            self.save()
        for link in self.links.values():
            link.compression.observe_step(tally.compute_s)
        for sender in self.pace.senders:
            self.tell(sender, ctl.Pace(step=t))  # the sender may now open step t + credit

    # -- messages ---------------------------------------------------------------------------------------
    def pump(self, until: Callable[[], bool]) -> None:
        """Handle messages until `until()` holds."""
        self._work()
        while not until():
            self.handle(self.recv())

    def recv(self) -> Message:
        started = clock = noticed = time.monotonic()  # self.timeout runs from `clock`, held while a site is down
        # with ranks, wake often enough to hear that one failed (its relay records it): a stage waiting for a
        # peer would otherwise learn it only at the next notice, 10 s later
        slice_s = RANK_CHECK_S if self.ranks is not None else WAIT_NOTICE_S
        while True:
            if self.ranks is not None:
                self.ranks.raise_if_failed()
            left = self.timeout - (time.monotonic() - clock)
            try:
                msg = self.channel.recv(timeout=max(0.0, min(slice_s, left)))
                break
            except RecvTimeout as exc:
                outages = self.channel.outages()
                now = time.monotonic()
                if outages:  # a WAN outage: the channel's wan_timeout bounds it, not this wait
                    clock = now
                elif left <= slice_s:
                    raise RecvTimeout(f"{self.name}: no message within {self.timeout:g} s; it was waiting for "
                                      f"{self._awaited_text()}") from exc
                if now - noticed >= WAIT_NOTICE_S - 1e-3:
                    noticed = now
                    self._waiting(now - started, outages)
        if msg.kind == Kind.ERROR:  # gateways' refusals are handled by the channel: this is a stage's
            raise RemoteError(msg.error_code, f"{msg.src} failed: {msg.error_message}; fix the cause there, "
                                              "then restart the job's stages")
        return msg

    def handle(self, msg: Message) -> None:
        sender = self.names.get(msg.src)
        if sender is None:
            raise StageError(f"{msg.src} sent a {msg.kind.name} message but is not a stage of job {self.job.name}")
        if msg.job and msg.job != self.job.name:  # every stage names its job; a bare test message may not
            raise StageError(f"{msg.src} sent a message of job {msg.job!r} to a stage of job {self.job.name!r}: "
                             "submit every site's half of a job under the id the first site issued "
                             "(`nebula job submit JOB.toml --join ID`)")
        if msg.kind == Kind.CONTROL:
            topic, body = ctl.parse_control(msg)
            if topic in PROTOCOL:  # the resume protocol crosses generations
                self.role.on_protocol(sender, topic, body)
            elif self.generations.admits(msg):
                self._control(sender, topic, body, msg)
        elif msg.kind == Kind.TENSORS:
            if self.generations.admits(msg):
                self._data(sender, msg)
        else:
            raise StageError(f"{msg.src} sent an unexpected {msg.kind.name} message to a stage")
        self._work()

    def _control(self, sender: str, topic: Topic, body: Any, msg: Message) -> None:
        if topic is Topic.PACE and self.pace.acknowledged(f"{self.name}->{sender}", body.step):
            return
        if topic is Topic.INFER_END:
            link = self._link(sender, self.name, "ended an inference pass")
            return self.inference.received(msg, link, None, None, body)
        if self.inference.on_control(sender, topic, body) or self.role.on_control(sender, topic, body):
            return
        raise StageError(f"{self.addresses[sender]} sent {topic.value!r} to {self.name}, which does not "
                         "expect it now (do all sites run the same job file?)")

    def _data(self, sender: str, msg: Message) -> None:
        topic = ctl.parse_data_topic(msg)
        if topic.kind is DataKind.BACKWARD:
            return self._gradients(self._link(self.name, sender, "sent gradients", backward=True), msg)
        link = self._link(sender, self.name, "sent tensors")
        inputs, ids = link.receive(msg, self.stage.device)
        assert ids is not None  # Link.receive refuses activations without their example ids
        if topic.kind is DataKind.INFER:
            return self.inference.received(msg, link, inputs, ids, topic)
        item = self.item_of.get((link.name, msg.micro_batch))
        ahead = min(self.train.steps, self.step + self.schedule.horizon)  # how far the schedule lets a sender run
        if item is None or not self.step < msg.step <= ahead:
            raise StageError(f"{msg.src} sent step {msg.step} micro-batch {msg.micro_batch}, which {self.name} does "
                             f"not expect (it applied step {self.step}, takes steps up to {ahead}; "
                             f"{len(self.items)} micro-batches per step)")
        state = self.open.setdefault(msg.step, StepState(msg.step))
        if item.index in state.arrived or (item.index < state.forwarded):
            raise StageError(f"{msg.src} sent step {msg.step} micro-batch {msg.micro_batch} twice: {self.name} "
                             "takes each once")
        state.arrived[item.index] = (Batch("train", msg.step, item.index, ids=ids, link=link.name), inputs)

    def _gradients(self, link: Link, msg: Message) -> None:
        state = self.open.get(msg.step)
        if state is None or msg.micro_batch >= state.forwarded:
            raise StageError(f"{msg.src} sent gradients for step {msg.step} micro-batch {msg.micro_batch}, "
                             f"which {self.name} has not sent (at step {self.step})")
        if msg.micro_batch < state.backwarded or link.name in state.grads.get(msg.micro_batch, {}):
            raise StageError(f"{msg.src} sent gradients for step {msg.step} micro-batch {msg.micro_batch} "
                             f"twice ({self.name} is at step {self.step}): a gradient is applied once")
        grads, _ = link.receive(msg, self.stage.device)
        state.grads.setdefault(msg.micro_batch, {})[link.name] = grads

    def _link(self, src: str, dst: str, what: str, backward: bool = False) -> Link:
        link = self.links.get(f"{src}->{dst}")
        if link is not None and (link.backward or not backward):
            return link
        who = self.addresses.get(src if dst == self.name else dst)
        raise StageError(f"{who} {what}, but the job has no {'two-way ' if backward else ''}link {src}->{dst}")

    def _emit(self, direction: str, link: LinkConfig, step: int, micro_batch: int, tensors: dict,
              ids: torch.Tensor | None, topic: DataTopic | None = None, generation: int | None = None) -> None:
        """The executor's (or another rank's) output for `link`: sent by this stage's end of it, stamped
        with the generation of the work item that made it."""
        end = self.links[link.name]
        assert end.direction == direction, (end.name, direction)  # the executor sends each way on the right end
        end.send(step, micro_batch, tensors, ids, self.generations.current if generation is None else generation,
                 topic)

    def tell(self, stage: str, body: Any, step: int | None = None) -> None:
        """Send control message `body` to `stage`, in order with the data this stage sends."""
        msg = ctl.control(body, self.job.name, self.addresses[stage], self.generations.current)
        msg.step = self.step if step is None else step
        self.sender.submit(lambda: msg)

    # -- what the coordinator's protocol calls ---------------------------------------------------------
    def abandon(self) -> None:
        """Drop whatever is in flight: unsent messages, open steps, inference in progress, and from
        now on what other stages still send of this generation (they may not have heard yet)."""
        self.generations.abandon()
        self.sender.discard()
        self.open.clear()
        self.inference.clear()

    def replay(self) -> None:
        """Handle what arrived early for the generation just entered."""
        self.generations.replay(self.handle)

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self) -> None:
        self.sender.settle()  # the codec state then covers exactly the messages sent so far
        path = self.checkpoints.save(self.step, {
            "stage": self.stage.state_dict(), "step": self.step, "ledger": self.ledger,
            "codecs": {name: link.compression.state_dict() for name, link in self.links.items()},
            **rng_state(self.stage.device), "seed": self.train.seed})
        self.metrics.event("checkpoint", step=self.step, file=str(path))

    def restore(self, step: int) -> None:
        """Load checkpoint `step` (0: the initial state saved at the first start)."""
        state = self.checkpoints.load(step)
        self.stage.load_state_dict(state["stage"])
        self.step, self.ledger = int(state["step"]), [list(e) for e in state["ledger"]]
        for name, link in self.links.items():
            link.compression.load_state_dict(state.get("codecs", {}).get(name, {"slots": []}))
        set_rng_state(state, self.stage.device)
        self.open.clear()
        self.executor.reset(self.step)
        self.last_update = None
        self.pace.reset(self.step)
        if self.ranks is not None:
            self.ranks.restore(self.checkpoints.file(step))

    def good_checkpoints(self) -> list[int]:
        """Steps of the checkpoints that match their checksum (a corrupt one is skipped, with a warning)."""
        return self.checkpoints.verified_steps(self.warn)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
        self.metrics.event("warning", message=text)

    # -- waiting and failing ---------------------------------------------------------------------------
    def _waiting(self, waited: float, outages: dict[str, float]) -> None:
        """The line an operator sees while this stage gets nothing (a peer down, restarting, or slow,
        or a site unreachable)."""
        stages = self._awaited()
        down = "".join(f"; site {site} unreachable for {s:.0f} s" for site, s in sorted(outages.items()))
        print(f"[{self.metrics.label}] waiting for {self._awaited_text(stages)} since {waited:.0f} s{down}",
              file=sys.stderr, flush=True)
        self.metrics.event("waiting", echo=False, stages=stages, since_s=round(waited, 1),
                           **({"unreachable_s": {k: round(v, 1) for k, v in outages.items()}} if outages else {}))

    def _awaited_text(self, stages: list[str] | None = None) -> str:
        stages = self._awaited() if stages is None else stages
        return ", ".join(f"{s} ({self.addresses[s]})" for s in stages) or "messages from the other stages"

    def _awaited(self) -> list[str]:
        """The stages whose messages this one needs next, from its state (best effort, for the waiting line)."""
        resuming = self.role.awaited_resume()
        if resuming is not None:
            return resuming
        t = self.step + 1
        state = self.open.get(t)
        if state is not None and state.forwarded < len(self.items):
            nxt = self.items[state.forwarded]
            if nxt.link is not None and nxt.index not in state.arrived:
                return [nxt.link.src]  # the next micro-batch, in canonical order
        if state is not None and self.waits and state.backwarded < state.forwarded:
            have = state.grads.get(state.backwarded, {})
            return [link.peer for link in self.out_links if link.backward and link.name not in have]
        lagging = self.pace.lagging(t)
        if self.is_source and self.step < self.train.steps and state is None and lagging:
            return lagging  # their PACE: the credit holds this source back
        ending = self.role.awaited_end()
        if ending is not None:
            return ending
        return [self.in_links[0].peer] if state is None and self.in_links else []

    def report(self, exc: BaseException, timeout: float = 5.0) -> None:
        """Best effort: tell the stages it works with why this one fails (the only ones whose channels
        take its messages); it exits anyway."""
        text = f"{type(exc).__name__}: {exc}"[:4000]
        for member in sorted(self.graph.peers(self.name)):
            msg = Message(kind=Kind.ERROR, job=self.job.name, dst=self.addresses[member], error_code="stage",
                          error_message=text, step=self.step, generation=self.generations.current)
            try:
                self.channel.send(msg, timeout=timeout)  # direct: the sender thread may be what failed
            except Exception as send_exc:  # noqa: BLE001 - reporting must not hide the original error
                print(f"warning: could not report the failure to {member}: {send_exc}", file=sys.stderr)
