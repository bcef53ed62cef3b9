"""One edge of the job graph as one of its two stages sees it: its config, its compression (codec
policy, codec state, byte meter), the ports its tensors must fit, and encode/decode.

The stage at the link's `from` end sends activations on it and, on a two-way link, receives their
gradients; the stage at its `to` end receives the activations and sends the gradients back. Either way
the link packs what goes out (on the stage's sender thread, so codec work overlaps the next compute)
and checks what comes in against its ports: a tensor that does not fit is a DataError naming the
sender, the link, the tensor and the port, which the runner reports to the peer.

Every data message carries the runtime's own tensor `example_ids` beside the link's tensors: (B,)
int64 hashes of the examples' ids, by which a downstream stage finds its side of the data (a decoder
its targets) and which the ledger records. Gradients carry none.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from nebula.errors import DataError
from nebula.runtime.compression import LinkCodecs, LinkMeter
from nebula.runtime.control import DataKind, DataTopic
from nebula.runtime.graph import LinkConfig, shape_text
from nebula.runtime.integrity import Integrity
from nebula.runtime.job import JobConfig
from nebula.runtime.sender import BackgroundSender
from nebula.runtime.stage import FLOAT, Port
from nebula.transport.base import Channel
from nebula.wire import Kind, Message

IDS = "example_ids"  # the runtime's own tensor on every data message: (B,) int64 example-id hashes


class Link:
    def __init__(self, config: LinkConfig, here: str, job: JobConfig, ports: Mapping[str, Port],
                 compression: LinkCodecs, sender: BackgroundSender, integrity: Integrity | None = None):
        self.config, self.name, self.job = config, config.name, job.name
        self.outgoing = config.src == here  # this stage sends the activations
        self.peer = config.dst if self.outgoing else config.src  # the stage at the other end
        self.address = job.stage(self.peer).address
        self.ports = {name: ports[name] for name in config.tensors}  # this end's ports for the link's tensors
        options = job.stage(here).options
        self.dims = {name: port.dims(options) for name, port in self.ports.items()}  # declared sizes, or None
        self.compression, self.sender = compression, sender
        self.integrity = integrity or Integrity(job.integrity)  # what it receives is checked before use
        self.direction = "forward" if self.outgoing else "backward"  # what this end sends on it
        # what comes back on an out-link: the gradients of its floating-point tensors
        self.gradients = [n for n in config.tensors if self.ports[n].dtype == FLOAT] if config.backward else []

    @classmethod
    def open(cls, config: LinkConfig, here: str, job: JobConfig, ports: Mapping[str, Port], sender: BackgroundSender,
             channel: Channel, meter: LinkMeter, spill_dir: Any, on_switch: Callable[..., None],
             integrity: Integrity | None = None) -> Link:
        """The link with its compression, whose `auto` goes by the goodput of the path it sends on."""
        compression = LinkCodecs(config.compression, config.name, meter, spill_dir=spill_dir)
        ends = {"forward": job.stage(config.dst).address, "backward": job.stage(config.src).address}
        compression.attach(lambda direction, size: channel.goodput(ends[direction], size), on_switch,
                           default_headroom=job.schedule.default_headroom)
        return cls(config, here, job, ports, compression, sender, integrity)

    @property
    def backward(self) -> bool:
        return self.config.backward

    @property
    def tensors(self) -> tuple[str, ...]:
        return self.config.tensors

    def send(self, step: int, micro_batch: int, tensors: dict[str, torch.Tensor], ids: torch.Tensor | None,
             generation: int, topic: DataTopic | None = None) -> None:
        """Queue `tensors` (activations from this link's `from` end, gradients from its `to` end);
        the codecs run on the sender thread."""
        topic = topic or DataTopic(DataKind.FORWARD if self.outgoing else DataKind.BACKWARD)
        split = topic.split if topic.kind is DataKind.INFER else None
        direction, compression = self.direction, self.compression

        def build() -> Message:
            payloads = [compression.pack(direction, name, tensor, step, ids=ids, split=split)
                        for name, tensor in tensors.items()]
            if ids is not None:
                payloads.append(compression.pack(direction, IDS, ids, step, split=split))
            return Message(kind=Kind.TENSORS, job=self.job, dst=self.address, step=step, micro_batch=micro_batch,
                           tensors=payloads, generation=generation, topic=str(topic))
        self.sender.submit(build)

    def receive(self, msg: Message, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The tensors of `msg` (activations on an in-link, with their example ids; gradients on an
        out-link), checked against this end's ports and moved to `device`."""
        tensors = {t.name: self.compression.unpack(t) for t in msg.tensors}
        example_ids = tensors.pop(IDS, None)
        names = self.tensors if not self.outgoing else self.gradients
        where = f"{msg.src} sent step {msg.step} on link {self.name}"
        if not self.outgoing and (example_ids is None or example_ids.dtype != torch.int64 or example_ids.dim() != 1):
            raise DataError(f"{where} without int64 (B,) {IDS!r}: both sites must run the same Nebula")
        if set(tensors) != set(names):
            raise DataError(f"{where} with tensors {sorted(tensors)}, expected {sorted(names)}: both sites must "
                            "run the same job file")
        for name, tensor in tensors.items():
            port = self.ports[name]
            why = port.accepts(tensor, None if example_ids is None else example_ids.shape[0])
            if why:
                raise DataError(f"{where}: {name!r} with {why} (port {port.name}: {port.dtype}, rank {port.rank}); "
                                "check the stage implementations at both ends")
            self._check_sizes(where, name, tensor)
            if tensor.is_floating_point():  # finite, and a norm in line with the link's (integrity.py)
                self.integrity.inspect(tensor, link=self.name, direction="backward" if self.outgoing else "forward",
                                       name=name, src=msg.src, step=msg.step, micro_batch=msg.micro_batch)
        return {n: t.to(device) for n, t in tensors.items()}, example_ids

    def _check_sizes(self, where: str, name: str, tensor: torch.Tensor) -> None:
        """A gradient comes back in the shape its activation went out (the executor checks that); what
        arrives on an in-link must have the sizes this stage declares for its input port, if it does."""
        dims = None if self.outgoing else self.dims[name]
        if dims is not None and any(d is not None and d != n for d, n in zip(dims, tensor.shape[1:])):
            raise DataError(f"{where}: {name!r} has shape {tuple(tensor.shape)}, but {self.config.dst} declares "
                            f"{shape_text(dims)} for its input port {name!r}; make the stages' options agree")

    def take_bytes(self) -> dict[str, int]:
        """Wire bytes sent each way since the last call, keyed "link:direction"."""
        return {f"{self.name}:{d}": n for d in ("forward", "backward") if (n := self.compression.take_bytes(d))}
