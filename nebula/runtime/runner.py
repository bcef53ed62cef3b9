"""The runtime of one stage: messages in, micro-batches through the executor, messages out.

Every stage runs the same loop. A source stage opens the steps (its examples, from the example
order) as the schedule allows; every stage forwards the micro-batches it has, in a fixed order,
backwards those whose gradients came back, and applies a step once all its micro-batches are
done. The schedule (docs/runtime.md) decides how far ahead a stage may run:
- synchronous: step t+1 starts once step t is applied everywhere upstream of a gradient;
- one-step-stale: a stage that waits for gradients forwards step t+1 before applying step t;
- forward-only links (any schedule): the sender opens step t only when each receiver has
  acknowledged step t - credit with a PACE message (paper §3.3, Figure 6).

Control messages (nebula.runtime.control) carry the resume protocol (nebula.runtime.coordinator),
inference passes and the end of the job. Every message is stamped with the sender's generation;
one of an older generation is dropped (it belongs to abandoned work), one of a newer generation
waits until this stage has resumed into it.
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
from nebula.runtime.checkpoint import CheckpointDir, checkpoints_to_keep, rng_state, set_rng_state
from nebula.runtime.control import DataKind, DataTopic, Topic
from nebula.runtime.coordinator import Phase
from nebula.runtime.executor import Executor
from nebula.runtime.graph import LinkConfig
from nebula.runtime.inference import InferencePasses
from nebula.runtime.compression import LinkCodecs, LinkMeter
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.order import ExampleOrder, digest
from nebula.runtime.resume import ResumeProtocol, Resync, held_bytes
from nebula.runtime.sender import BackgroundSender
from nebula.runtime.stage import FLOAT, Batch, Port, Stage
from nebula.transport.base import Channel
from nebula.wire import Kind, Message

IDS = "example_ids"  # the runtime's own tensor on every data message: (B,) int64 example-id hashes
# what a stage keeps of a generation it has not resumed into yet: a peer that resumed first runs at most
# its pace credit ahead (a few micro-batches per link); past this, it is flooding the stage
LATER_BYTES = 1 << 30
WAIT_NOTICE_S = 10.0  # a stage that has received nothing for this long says whom it waits for, and again as often


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


class StageRunner(ResumeProtocol, InferencePasses):
    def __init__(self, job: Any, name: str, stage: Stage, channel: Channel, workdir: Path,
                 metrics: MetricsLog, ranks: Any = None, timeout: float = 300.0):
        self.job, self.name, self.stage, self.channel = job, name, stage, channel
        self.graph, self.train, self.schedule = job.graph, job.train, job.schedule
        self.workdir, self.metrics, self.ranks, self.timeout = Path(workdir), metrics, ranks, timeout
        self.addresses = {n: s.address for n, s in job.stages.items()}
        self.names = {a: n for n, a in self.addresses.items()}
        self.in_links, self.out_links = self.graph.in_links[name], self.graph.out_links[name]
        meter = LinkMeter(self.workdir / "link.jsonl")
        self.codecs = {}
        for link in (*self.in_links, *self.out_links):  # `auto` goes by the goodput of the path it sends on
            ends = {"forward": self.addresses[link.dst], "backward": self.addresses[link.src]}
            self.codecs[link.name] = LinkCodecs(link.compression, link.name, meter, spill_dir=self.workdir)
            self.codecs[link.name].attach(lambda direction, size, ends=ends: channel.goodput(ends[direction], size),
                                          lambda **event: metrics.event("compression", **event),
                                          stale=bool(self.schedule.stale))
        self.items = self.graph.items(name)
        self.item_of = {(i.link.name if i.link else None, i.micro_batch): i for i in self.items}
        self.waits = self.graph.waits_for_gradients(name)
        self.two_way_out = sum(link.backward for link in self.out_links)  # gradients awaited per micro-batch
        self.in_ports = {p.name: p for p in type(stage).inputs}
        self.out_ports = {p.name: p for p in type(stage).outputs}
        self.executor = Executor(stage, self.graph, name, self.train, self.schedule.stale, self._emit,
                                 reduce=ranks.reduce if ranks else None)
        self.sender = BackgroundSender(channel, timeout)
        if ranks is not None:
            ranks.attach(self._emit, self.executor)
        self.checkpoints = CheckpointDir(self.workdir / "checkpoints", checkpoints_to_keep(
            len(self.graph.stages), self.schedule.pace_credit, self.train.checkpoint_every))
        self.step, self.generation, self.ledger = 0, 0, []
        self.open: dict[int, StepState] = {}  # steps started and not applied yet
        self.acked = {link.name: 0 for link in self.out_links if not link.backward}  # PACE per forward-only link
        self.last_update: float | None = None
        self.finish_at: int | None = None  # the step FINISH asked this stage to reach
        self.ended: set[str] = set()  # coordinator: sources through training
        self.done: set[str] = set()  # coordinator: members that saved and exit
        self.finishing = False
        self._order: ExampleOrder | None = None
        self.init_resume()
        self.init_inference()

    # -- lifecycle ---------------------------------------------------------------------------------
    def run(self, hook: Callable[["StageRunner"], Any] | None = None, train: bool = True) -> Any:
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
                            result = hook(self) if hook is not None else self.stage.after_training(self)
                            hooked_at = self.step
                    self._end(self.train.steps if train else self.step)
                    break
                except Resync as resync:
                    self._recover(resync)
            self._final()
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
        if not self.checkpoints.steps():
            self.save()
        if self.is_coordinator:
            self._coordinate()
        else:
            self._join(0)

    def close(self) -> None:
        self.sender.close()

    # -- training ------------------------------------------------------------------------------------
    def _train_to(self, last: int) -> None:
        while self.step < last:
            t = self.step + 1
            if t not in self.open:
                self._open(t)
            # saves_after(t) is also true at the last step: nothing runs past the end
            if self.schedule.stale and self.waits and not self.train.saves_after(t) and t + 1 not in self.open:
                self._open(t + 1)  # PipeDream-2BW: the next forward before this update
            self.pump(lambda: self.step >= t)

    def _open(self, t: int) -> None:
        """A source opens step t: its micro-batches, once every forward-only receiver allows it."""
        credit = self.schedule.pace_credit
        self.pump(lambda: all(acked >= t - credit for acked in self.acked.values()))
        hashes = self._example_hashes("train")
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
                batch, inputs = state.arrived.pop(state.forwarded)
                state.ids += batch.ids.tolist()
                self._forward(batch, inputs, self.items[state.forwarded])
                state.forwarded += 1
                return True
        for t in sorted(self.open):
            state = self.open[t]
            if self.waits and state.backwarded < state.forwarded and self._has_grads(state, state.backwarded):
                grads = state.grads.pop(state.backwarded)
                if self.ranks is not None:
                    self.ranks.backward(t, state.backwarded, grads, self.generation)
                else:
                    self.executor.backward(t, state.backwarded, grads)
                state.backwarded += 1
                return True
        state = self.open.get(self.step + 1)
        if state is not None and state.forwarded == len(self.items) \
                and (not self.waits or state.backwarded == len(self.items)):
            self._apply(self.open.pop(self.step + 1))
            return True
        if self.inference and self.inference[0][0].step <= self.step:
            self._infer(*self.inference.popleft())
            return True
        return False

    def _forward(self, batch: Batch, inputs: dict, item) -> None:
        if self.ranks is not None:
            self.ranks.forward(batch, inputs, item, self.generation)
        else:
            self.executor.forward(batch, inputs, item)

    def _has_grads(self, state: StepState, index: int) -> bool:
        return len(state.grads.get(index, {})) == self.two_way_out

    def _apply(self, state: StepState) -> None:
        tally = self.ranks.apply(state.step) if self.ranks is not None else self.executor.apply(state.step)
        now, t = time.perf_counter(), state.step
        since = state.started if self.last_update is None else self.last_update  # update to update
        self.step, self.last_update = t, now
        self.ledger.append([t, digest(state.ids)])
        if tally.stats.get("tokens"):  # bytes_per_token below: this step's messages, all encoded, none of the next
            self.sender.settle()
        # wire bytes the sender thread has encoded since the last record (link.jsonl has them by step)
        sent = {f"{name}:{d}": n for name, c in self.codecs.items() for d in ("forward", "backward")
                if (n := c.take_bytes(d))}
        extra = {} if tally.loss is None else {"loss": tally.loss}
        if tally.stats:
            extra["stats"] = tally.stats
            if tally.stats.get("tokens"):  # what one token of this stage's data costs on each link
                extra["bytes_per_token"] = {k: round(n / tally.stats["tokens"], 4) for k, n in sent.items()}
        self.metrics.step(step=t, step_s=now - since, compute_s=tally.compute_s, **extra, sent=sent)
        # saved after the step's record: a kill in between runs the step again (two records, the last
        # counts), where saving first could leave an applied step with no record at all
        if self.train.saves_after(t):
            self.save()
        for link_codecs in self.codecs.values():
            link_codecs.observe_step(tally.compute_s)
        for link in self.in_links:
            if not link.backward:
                self._tell(link.src, ctl.Pace(step=t))  # the sender may now open step t + credit

    # -- messages ---------------------------------------------------------------------------------------
    def pump(self, until: Callable[[], bool]) -> None:
        """Handle messages until `until()` holds."""
        self._work()
        while not until():
            self.handle(self.recv())

    def recv(self) -> Message:
        started = clock = time.monotonic()  # self.timeout runs from `clock`, held while a site is unreachable
        while True:
            if self.ranks is not None:
                self.ranks.raise_if_failed()
            left = self.timeout - (time.monotonic() - clock)
            try:
                msg = self.channel.recv(timeout=max(0.0, min(WAIT_NOTICE_S, left)))
                break
            except RecvTimeout as exc:
                outages = self.channel.outages()
                if outages:  # a WAN outage: the channel's wan_timeout bounds it, not this wait
                    clock = time.monotonic()
                elif left <= WAIT_NOTICE_S:
                    raise RecvTimeout(f"{self.name}: no message within {self.timeout:g} s; it was waiting for "
                                      f"{self._awaited_text()}") from exc
                self._waiting(time.monotonic() - started, outages)
        if msg.kind == Kind.ERROR:  # gateways' refusals are handled by the channel: this is a stage's
            raise RemoteError(msg.error_code, f"{msg.src} failed: {msg.error_message}; fix the cause there, "
                                              "then restart the job's stages")
        return msg

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
        t, coordinator = self.step + 1, self.graph.coordinator
        if self.is_coordinator and self.coordination.phase is not Phase.TRAINING:  # a resume round
            got = self.coordination.answers if self.coordination.phase is Phase.HELLOS else self.coordination.ready
            return [m for m in self.members if m not in got]
        if not self.is_coordinator and self.joining is not None:
            return [coordinator]  # its RESUME
        state = self.open.get(t)
        nxt = self.items[state.forwarded] if state is not None and state.forwarded < len(self.items) else None
        if nxt is not None and nxt.link is not None and nxt.index not in state.arrived:
            return [nxt.link.src]  # the next micro-batch, in canonical order
        if state is not None and self.waits and state.backwarded < state.forwarded:
            have = state.grads.get(state.backwarded, {})
            return [link.dst for link in self.out_links if link.backward and link.name not in have]
        lagging = [link.dst for link in self.out_links
                   if not link.backward and self.acked[link.name] < t - self.schedule.pace_credit]
        if self.is_source and self.step < self.train.steps and state is None and lagging:
            return lagging  # their PACE: the credit holds this source back
        if self.is_coordinator and self.step >= self.train.steps:  # the end of the job
            return [m for m in self.members if m not in self.done] if self.finishing else \
                [s for s in self.graph.sources if s not in self.ended]
        if not self.is_coordinator and self.step >= (self.finish_at or self.train.steps):
            return [coordinator]  # its FINISH
        return [self.items[0].link.src] if state is None and self.in_links else []

    def handle(self, msg: Message) -> None:
        sender = self.names.get(msg.src)
        if sender is None:
            raise StageError(f"{msg.src} sent a {msg.kind.name} message but is not a stage of job {self.job.name}")
        if msg.kind == Kind.CONTROL:
            topic, body = ctl.parse_control(msg)
            if topic in (Topic.HELLO, Topic.RESYNC, Topic.RESUME, Topic.READY):
                self._protocol(sender, topic, body)
            elif self._current(msg):
                self._control(sender, topic, body, msg)
        elif msg.kind == Kind.TENSORS:
            if self._current(msg):
                self._data(sender, msg)
        else:
            raise StageError(f"{msg.src} sent an unexpected {msg.kind.name} message to a stage")
        self._work()

    def _current(self, msg: Message) -> bool:
        """Whether `msg` belongs to this generation (older, or this one once it is abandoned:
        dropped; newer: kept for later)."""
        if msg.generation > self.generation:
            self._keep_for_later(msg)
        return msg.generation == self.generation >= self.floor

    def _keep_for_later(self, msg: Message) -> None:
        size = held_bytes(msg)
        if self.later_bytes + size > LATER_BYTES:
            raise StageError(f"{msg.src} sent generation {msg.generation} while {self.name} is in "
                             f"{self.generation}: {len(self.later) + 1} such messages, over the "
                             f"{LATER_BYTES >> 20} MiB a stage keeps until it resumes; a peer is flooding it")
        self.later.append(msg)
        self.later_bytes += size

    def _data(self, sender: str, msg: Message) -> None:
        topic = ctl.parse_data_topic(msg)
        if topic.kind is DataKind.BACKWARD:
            link = self._link(self.name, sender, "sent gradients", backward=True)
            state = self.open.get(msg.step)
            if state is None or msg.micro_batch >= state.forwarded:
                raise StageError(f"{msg.src} sent gradients for step {msg.step} micro-batch {msg.micro_batch}, "
                                 f"which {self.name} has not sent (at step {self.step})")
            if msg.micro_batch < state.backwarded or link.name in state.grads.get(msg.micro_batch, {}):
                raise StageError(f"{msg.src} sent gradients for step {msg.step} micro-batch {msg.micro_batch} "
                                 f"twice ({self.name} is at step {self.step}): a gradient is applied once")
            grads, _ = self._decode(msg, link, [n for n in link.tensors if self.out_ports[n].dtype == FLOAT],
                                    self.out_ports, ids=False)
            state.grads.setdefault(msg.micro_batch, {})[link.name] = grads
            return
        link = self._link(sender, self.name, "sent tensors")
        inputs, ids = self._decode(msg, link, list(link.tensors), self.in_ports, ids=True)
        if topic.kind is DataKind.INFER:
            self._check_inference(msg, topic.origin)
            self.inference.append((msg, link, inputs, ids, topic))
            return
        item = self.item_of.get((link.name, msg.micro_batch))
        # a sender runs at most its pace credit (and the schedule's one step) ahead of this stage
        ahead = min(self.train.steps, self.step + self.schedule.pace_credit + 2)
        if item is None or not self.step < msg.step <= ahead:
            raise StageError(f"{msg.src} sent step {msg.step} micro-batch {msg.micro_batch}, which {self.name} does "
                             f"not expect (it applied step {self.step}, takes steps up to {ahead}; "
                             f"{len(self.items)} micro-batches per step)")
        state = self.open.setdefault(msg.step, StepState(msg.step))
        if item.index in state.arrived or (item.index < state.forwarded):
            raise StageError(f"{msg.src} sent step {msg.step} micro-batch {msg.micro_batch} twice: {self.name} "
                             "takes each once")
        state.arrived[item.index] = (Batch("train", msg.step, item.index, ids=ids, link=link.name), inputs)

    def _check_inference(self, msg: Message, origin: str) -> None:
        if origin not in self.addresses:
            raise StageError(f"{msg.src} sent an inference pass of {origin!r}, which is no stage of the job "
                             f"({', '.join(sorted(self.addresses))})")
        if not 0 <= msg.step <= self.train.steps:
            raise StageError(f"{msg.src} sent an inference pass at step {msg.step}; the job has "
                             f"{self.train.steps} steps")

    def _decode(self, msg: Message, link: LinkConfig, names: list[str], ports: dict[str, Port],
                ids: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The tensors of `msg`, checked against the ports: a mismatch is a DataError naming it."""
        tensors = {t.name: self.codecs[link.name].unpack(t) for t in msg.tensors}
        example_ids = tensors.pop(IDS, None)
        where = f"{msg.src} sent step {msg.step} on link {link.name}"
        if ids and (example_ids is None or example_ids.dtype != torch.int64 or example_ids.dim() != 1):
            raise DataError(f"{where} without int64 (B,) {IDS!r}: both sites must run the same Nebula")
        if set(tensors) != set(names):
            raise DataError(f"{where} with tensors {sorted(tensors)}, expected {sorted(names)}: both sites must "
                            "run the same job file")
        for name, tensor in tensors.items():
            why = ports[name].accepts(tensor, None if example_ids is None else example_ids.shape[0])
            if why:
                raise DataError(f"{where}: {name!r} with {why} (port {ports[name].name}: {ports[name].dtype}, "
                                f"rank {ports[name].rank}); check the stage implementations at both ends")
        return {n: t.to(self.stage.device) for n, t in tensors.items()}, example_ids

    def _link(self, src: str, dst: str, what: str, backward: bool = False) -> LinkConfig:
        link = self.graph.links_by_name.get(f"{src}->{dst}")
        if link is not None and (link.backward or not backward):
            return link
        who = self.addresses.get(src if dst == self.name else dst)
        raise StageError(f"{who} {what}, but the job has no {'two-way ' if backward else ''}link {src}->{dst}")

    def _emit(self, direction: str, link: LinkConfig, step: int, micro_batch: int, tensors: dict,
              ids: torch.Tensor | None, topic: DataTopic | None = None, generation: int | None = None) -> None:
        """Queue tensors for `link` (on the sender thread: codec work overlaps the next compute).
        Another rank's output comes with the generation of the work item that made it."""
        topic = topic or DataTopic(DataKind.FORWARD if direction == "forward" else DataKind.BACKWARD)
        dst = self.addresses[link.dst if direction == "forward" else link.src]
        codecs = self.codecs[link.name]
        generation = self.generation if generation is None else generation

        split = topic.split if topic.kind is DataKind.INFER else None

        def build() -> Message:
            payloads = [codecs.pack(direction, name, tensor, step, ids=ids, split=split)
                        for name, tensor in tensors.items()]
            if ids is not None:
                payloads.append(codecs.pack(direction, IDS, ids, step, split=split))
            return Message(kind=Kind.TENSORS, job=self.job.name, dst=dst, step=step, micro_batch=micro_batch,
                           tensors=payloads, generation=generation, topic=str(topic))
        self.sender.submit(build)

    def _tell(self, stage: str, body: Any, step: int | None = None) -> None:
        msg = ctl.control(body, self.job.name, self.addresses[stage], self.generation)
        msg.step = self.step if step is None else step
        self.sender.submit(lambda: msg)

    # -- control: pace, inference, the end ---------------------------------------------------------------
    def _control(self, sender: str, topic: Topic, body: Any, msg: Message) -> None:
        if topic is Topic.PACE and (link := f"{self.name}->{sender}") in self.acked:
            self.acked[link] = max(self.acked[link], body.step)
        elif topic is Topic.INFER_END:
            self._check_inference(msg, body.origin)
            self.inference.append((msg, self._link(sender, self.name, "ended an inference pass"), None, None, body))
        elif topic is Topic.INFER_PROGRESS and body.split in self.asked:
            total, batch_size = self._asking
            if body.n == total or body.n % (8 * batch_size) < batch_size:  # every 8th batch, and the last
                self.metrics.event("decoded", split=body.split, n=body.n, of=total)
        elif topic is Topic.SCORES and body.split in self.asked:
            self.asked[body.split][body.sink] = body.scores
        elif topic is Topic.ENDED and self.is_coordinator:
            self.ended.add(sender)
        elif topic is Topic.FINISH and sender == self.graph.coordinator:
            self.finish_at = body.step
        elif topic is Topic.DONE and self.is_coordinator:
            self.done.add(sender)
        else:
            raise StageError(f"{self.addresses[sender]} sent {topic.value!r} to {self.name}, which does not "
                             "expect it now (do all sites run the same job file?)")

    def _end(self, target: int) -> None:
        """Sources report that they are through; the coordinator then finishes every member."""
        if self.is_coordinator:
            if self.is_source:
                self.ended.add(self.name)
            self.pump(lambda: self.ended >= set(self.graph.sources))
            self.finish_at, self.finishing = target, True
            for member in self.members:
                self._tell(member, ctl.Finish(step=target))
            self.pump(lambda: self.step >= target and self.done >= set(self.members))
        else:
            if self.is_source:
                self._tell(self.graph.coordinator, ctl.Ended(step=self.step))
            self.pump(lambda: self.finish_at is not None and self.step >= self.finish_at)

    def _final(self) -> None:
        if self.step not in self.checkpoints.steps():
            self.save()
        (self.workdir / "ledger.json").write_text(json.dumps({"steps": self.ledger}))
        if not self.is_coordinator:
            self._tell(self.graph.coordinator, ctl.Done(step=self.step))
        self.sender.flush()

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self) -> None:
        self.sender.settle()  # the codec state then covers exactly the messages sent so far
        self.checkpoints.save(self.step, {
            "stage": self.stage.state_dict(), "step": self.step, "ledger": self.ledger,
            "codecs": {name: c.state_dict() for name, c in self.codecs.items()},
            **rng_state(self.stage.device), "seed": self.train.seed})

    def restore(self, step: int) -> None:
        """Load checkpoint `step` (0: the initial state saved at the first start)."""
        state = self.checkpoints.load(step)
        self.stage.load_state_dict(state["stage"])
        self.step, self.ledger = int(state["step"]), [list(e) for e in state["ledger"]]
        for name, codecs in self.codecs.items():
            codecs.load_state_dict(state.get("codecs", {}).get(name, {"slots": []}))
        set_rng_state(state, self.stage.device)
        self.open.clear()
        self.executor.reset(self.step)
        self.last_update = None
        self.acked = {name: self.step for name in self.acked}
        if self.ranks is not None:
            self.ranks.restore(self.checkpoints.file(step))

    def good_checkpoints(self) -> list[int]:
        """Steps of the checkpoints that match their checksum (a corrupt one is skipped, with a warning)."""
        return self.checkpoints.verified_steps(self.warn)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
        self.metrics.event("warning", message=text)

    # -- failures --------------------------------------------------------------------------------------
    def report(self, exc: BaseException, timeout: float = 5.0) -> None:
        """Best effort: tell the stages it works with why this one fails (the only ones whose channels
        take its messages); it exits anyway."""
        text = f"{type(exc).__name__}: {exc}"[:4000]
        for member in sorted(self.graph.peers(self.name)):
            msg = Message(kind=Kind.ERROR, job=self.job.name, dst=self.addresses[member], error_code="stage",
                          error_message=text, step=self.step, generation=self.generation)
            try:
                self.channel.send(msg, timeout=timeout)  # direct: the sender thread may be what failed
            except Exception as send_exc:  # noqa: BLE001 - reporting must not hide the original error
                print(f"warning: could not report the failure to {member}: {send_exc}", file=sys.stderr)
