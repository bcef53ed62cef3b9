"""What one stage sends, in order, on its one sender thread: its links' tensors and its control messages.

The links (nebula.runtime.link) encode on the sender thread (nebula.runtime.sender), so codec work and
the wire overlap the next computation, and a peer sees data and control in the order they were sent.
Every message is stamped with the generation of the work that made it (nebula.runtime.generations).
Computations emit through `emit`, the coordinator and the inference passes `tell`; none holds the runner.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from nebula.errors import StageError, TransportError
from nebula.runtime import control as ctl
from nebula.runtime.compression import LinkMeter
from nebula.runtime.control import DataTopic
from nebula.runtime.generations import Generations
from nebula.runtime.graph import LinkConfig
from nebula.runtime.inbox import REFUSED
from nebula.runtime.integrity import BadTensor, Integrity
from nebula.runtime.job import JobConfig
from nebula.runtime.link import Link
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.sender import BackgroundSender
from nebula.runtime.stage import Port
from nebula.transport.base import Channel
from nebula.wire import Kind, Message


class Outbox:
    check_outgoing: ClassVar[bool] = True  # what it sends is checked first (a hostile peer's code would not)

    def __init__(self, job: JobConfig, name: str, ports: tuple[Sequence[Port], Sequence[Port]], channel: Channel,
                 workdir: Path, metrics: MetricsLog, generations: Generations, applied: Callable[[], int],
                 timeout: float):
        self.job, self.name, self.channel, self.generations, self.applied = job, name, channel, generations, applied
        self.addresses = {n: s.address for n, s in job.stages.items()}
        self.sender = BackgroundSender(channel, timeout)
        meter = LinkMeter(Path(workdir) / "link.jsonl")
        on_switch = lambda **event: metrics.event("compression", **event)  # noqa: E731 - `auto` changed rung
        graph = job.graph
        self.integrity = Integrity.for_stage(job.integrity, Path(workdir), metrics)  # what its links receive
        sides = {"in": {p.name: p for p in ports[0]}, "out": {p.name: p for p in ports[1]}}  # Stage.ports
        self.links = {config.name: Link.open(config, name, job, sides["out" if config.src == name else "in"],
                                             self.sender, channel, meter, workdir, on_switch, self.integrity)
                      for config in (*graph.in_links[name], *graph.out_links[name])}
        self.in_links = [self.links[link.name] for link in graph.in_links[name]]
        self.out_links = [self.links[link.name] for link in graph.out_links[name]]
        self._withheld: list[BadTensor] = []  # its own bad tensors, not sent: the runner aborts their steps
        self._lock = threading.Lock()  # emit also runs on a rank group's relay thread

    def link(self, src: str, dst: str, what: str, backward: bool = False) -> Link:
        """This stage's end of link src->dst, which a peer just used for `what` (a StageError if the job
        has no such link, or it carries no gradients and `backward`)."""
        link = self.links.get(f"{src}->{dst}")
        if link is not None and (link.backward or not backward):
            return link
        who = self.addresses.get(src if dst == self.name else dst)
        raise StageError(f"{who} {what}, but the job has no {'two-way ' if backward else ''}link {src}->{dst}")

    def emit(self, direction: str, link: LinkConfig, step: int, micro_batch: int, tensors: dict,
             ids: torch.Tensor | None, topic: DataTopic | None = None, generation: int | None = None) -> None:
        """A computation's (or another rank's) output for `link`, sent by this stage's end of it, stamped
        with the generation of the work item that made it."""
        end = self.links[link.name]
        assert end.direction == direction, (end.name, direction)  # each way on the right end
        if topic is None and self.check_outgoing and self._bad(end, direction, step, micro_batch, tensors):
            return  # training data only: an inference pass refuses its bad tensors where they arrive
        end.send(step, micro_batch, tensors, ids, self.generations.current if generation is None else generation,
                 topic)

    def _bad(self, end: Link, direction: str, step: int, micro_batch: int, tensors: dict) -> bool:
        """Whether one of `tensors` holds NaN/Inf: then none is encoded or sent, and its step is to be
        aborted (`withheld`); the codecs' state never sees it, whatever the codec."""
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                bad = self.integrity.outgoing(tensor, link=end.name, direction=direction, name=name, step=step,
                                              micro_batch=micro_batch)
                if bad is not None:
                    with self._lock:
                        self._withheld.append(bad)
                    return True
        return False

    def withheld(self) -> list[BadTensor]:
        """The bad tensors of its own it did not send since the last call."""
        with self._lock:
            found, self._withheld = self._withheld, []
        return found

    def refuse(self, dst: str, bad: BadTensor, timeout: float = 5.0) -> None:
        """Tell stage `dst` its tensor was refused (an ERROR `refused`; its channel does not fail on it).
        Sent at once, not queued: the resume that follows the refusal drops what is queued."""
        msg = Message(kind=Kind.ERROR, job=self.job.name, dst=self.addresses[dst], error_code=REFUSED,
                      error_message=str(bad)[:4000], step=bad.step, generation=self.generations.current)
        try:
            self.channel.send(msg, timeout=timeout)
        except TransportError as exc:  # its own records hold the refusal; the sender learns of it at the resume
            print(f"warning: could not tell {dst} its tensor was refused: {exc}", file=sys.stderr)

    def paced(self, senders: list[str], t: int) -> None:
        """Step t is done with here (applied or skipped): `senders` may now open step t + credit."""
        for sender in senders:
            self.tell(sender, ctl.Pace(step=t))

    def tell(self, stage: str, body: Any, step: int | None = None) -> None:
        """Control message `body` to `stage`, in order with the data this stage sends."""
        msg = ctl.control(body, self.job.name, self.addresses[stage], self.generations.current)
        msg.step = self.applied() if step is None else step
        self.sender.submit(lambda: msg)

    def report(self, exc: BaseException, timeout: float = 5.0) -> None:
        """Best effort: tell the stages it works with why this one fails (the only ones whose channels
        take its messages); it exits anyway."""
        text = f"{type(exc).__name__}: {exc}"[:4000]
        for member in sorted(self.job.graph.peers(self.name)):
            msg = Message(kind=Kind.ERROR, job=self.job.name, dst=self.addresses[member], error_code="stage",
                          error_message=text, step=self.applied(), generation=self.generations.current)
            try:
                self.channel.send(msg, timeout=timeout)  # direct: the sender thread may be what failed
            except Exception as send_exc:  # noqa: BLE001 - reporting must not hide the original error
                print(f"warning: could not report the failure to {member}: {send_exc}", file=sys.stderr)

    def take_bytes(self) -> dict[str, int]:
        """Wire bytes sent on every link each way since the last call ("link:direction")."""
        return {key: n for link in self.links.values() for key, n in link.take_bytes().items()}

    def codec_state(self) -> dict[str, Any]:
        return {name: link.compression.state_dict() for name, link in self.links.items()}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        for name, link in self.links.items():
            link.compression.load_state_dict(state.get(name, {"slots": []}))

    def observe_step(self, compute_s: float) -> None:
        for link in self.links.values():
            link.compression.observe_step(compute_s)

    def close(self) -> None:
        self.sender.close()
        self.integrity.close()
