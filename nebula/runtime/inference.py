"""Inference passes through the graph: a source sends the batches of a split along its out-links,
every stage on the way forwards them without gradients, and each sink runs its `infer` and, at the
end marker, its `score`, which goes back to the source that asked.

Inference messages and end markers are handled in arrival order, each once the stage's weights are
at least those of the step the source evaluates, so an evaluation after training uses every
stage's final weights even where a forward-only link lets a receiver lag.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nebula.errors import StageError
from nebula.runtime import control as ctl
from nebula.runtime.compute import Compute
from nebula.runtime.control import DataTopic, Topic
from nebula.runtime.graph import Graph
from nebula.runtime.link import Link
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.outbox import Outbox
from nebula.runtime.progress import Progress
from nebula.runtime.stage import Batch, Stage
from nebula.wire import Message

PASS_TOPICS = (Topic.INFER_END, Topic.INFER_PROGRESS, Topic.SCORES)


@dataclass(frozen=True)
class Handle:
    """What inference passes may see and do of their stage."""

    name: str
    graph: Graph
    stage: Stage  # infer, score
    compute: Compute  # infer_forward
    outbox: Outbox  # the out-links, tell
    progress: Progress  # the step whose weights are used
    metrics: MetricsLog
    pump: Callable[[Callable[[], bool]], None]
    hashes: Callable[[str], torch.Tensor]  # a split's example-id hashes


class Inference:
    def __init__(self, handle: Handle):
        self.handle = handle
        self.queue: deque = deque()  # (message, link, inputs, ids, topic or end marker), arrival order
        self.results: dict[tuple[str, str], list] = {}  # sink: (origin, split) -> results so far
        self.ends: dict[tuple[str, str], int] = {}  # sink: end markers seen per pass
        self.asked: dict[str, dict[str, Any]] = {}  # origin: split -> sink -> scores
        self._asking = (0, 1)  # origin: (examples, batch size) of the pass in progress

    def clear(self) -> None:
        """A resume: passes in progress are abandoned (the origin asks again)."""
        self.queue.clear()
        self.results.clear()
        self.ends.clear()
        self.asked.clear()

    def evaluate(self, split: str, indices: list[int], batch_size: int) -> dict[str, Any]:
        """Inference from this source on examples `indices` of `split`: its outputs travel the links
        (with their codecs) to the sinks, which run their `infer` and `score`; -> {sink: scores}."""
        handle = self.handle
        topic, hashes = ctl.infer_topic(handle.name, split), handle.hashes(split)
        sinks = handle.graph.reachable_sinks(handle.name)
        self.asked[split], self._asking, local = {}, (len(indices), batch_size), []
        for b, start in enumerate(range(0, len(indices), batch_size)):
            chosen = indices[start:start + batch_size]
            batch = Batch(split, handle.progress.step, b, ids=hashes[chosen], training=False, indices=chosen)
            if not handle.outbox.out_links:  # a one-stage job: this stage is its own sink
                local += self._sink_infer(batch, {})
                continue
            out = handle.compute.infer_forward(batch, {})
            self._forward(handle.progress.step, b, out.tensors, batch.ids, topic)
        if not handle.outbox.out_links:
            return {handle.name: handle.stage.score(split, local)}
        for link in handle.outbox.out_links:
            handle.outbox.tell(link.peer, ctl.InferEnd(origin=handle.name, split=split))
        handle.pump(lambda: set(self.asked[split]) >= set(sinks))
        return self.asked.pop(split)

    def received(self, msg: Message, link: Link, inputs: dict | None, ids: Any, what: Any) -> None:
        """An inference batch (`what`: its DataTopic) or an end marker (ctl.InferEnd) arrived on `link`."""
        self.check(msg, what.origin)
        self.queue.append((msg, link, inputs, ids, what))

    def on_control(self, sender: str, topic: Topic, body: Any) -> bool:
        """Progress and scores from a sink; False if no pass asked for them."""
        if topic is Topic.INFER_PROGRESS and body.split in self.asked:
            total, batch_size = self._asking
            if body.n == total or body.n % (8 * batch_size) < batch_size:  # every 8th batch, and the last
                self.handle.metrics.event("decoded", split=body.split, n=body.n, of=total)
        elif topic is Topic.SCORES and body.split in self.asked:
            self.asked[body.split][body.sink] = body.scores
        else:
            return False
        return True

    def due(self) -> bool:
        """Whether the next batch or end marker may run: the stage's weights are those it evaluates."""
        return bool(self.queue) and self.queue[0][0].step <= self.handle.progress.step

    def run_next(self) -> None:
        msg, link, inputs, ids, what = self.queue.popleft()
        handle = self.handle
        if isinstance(what, ctl.InferEnd):
            return self._end(msg, what)
        batch = Batch(what.split, msg.step, msg.micro_batch, ids=ids, training=False, link=link.name)
        if handle.outbox.out_links:
            out = handle.compute.infer_forward(batch, inputs)
            return self._forward(msg.step, msg.micro_batch, out.tensors, ids, what)
        results = self.results.setdefault((what.origin, what.split), [])
        results += self._sink_infer(batch, inputs)
        # the origin hears that decoding goes on: a long evaluation is progress, not a silent peer
        handle.outbox.tell(what.origin, ctl.InferProgress(split=what.split, n=len(results)), step=msg.step)

    def check(self, msg: Message, origin: str) -> None:
        handle = self.handle
        if origin not in handle.graph.stages:
            raise StageError(f"{msg.src} sent an inference pass of {origin!r}, which is no stage of the job "
                             f"({', '.join(sorted(handle.graph.stages))})")
        if not 0 <= msg.step <= handle.progress.train.steps:
            raise StageError(f"{msg.src} sent an inference pass at step {msg.step}; the job has "
                             f"{handle.progress.train.steps} steps")

    def _forward(self, step: int, micro_batch: int, tensors: dict, ids: torch.Tensor, topic: DataTopic) -> None:
        handle = self.handle
        for link in handle.outbox.out_links:
            handle.outbox.emit("forward", link.config, step, micro_batch, {n: tensors[n] for n in link.tensors}, ids,
                               topic)

    def _end(self, msg: Message, what: ctl.InferEnd) -> None:
        handle = self.handle
        if handle.outbox.out_links:
            for out in handle.outbox.out_links:
                handle.outbox.tell(out.peer, what, step=msg.step)
            return
        key = (what.origin, what.split)
        self.ends[key] = self.ends.get(key, 0) + 1
        if self.ends[key] == handle.graph.paths(what.origin, handle.name):
            scores = handle.stage.score(what.split, self.results.pop(key, []))
            del self.ends[key]
            handle.outbox.tell(what.origin, ctl.Scores(split=what.split, sink=handle.name, scores=scores),
                               step=msg.step)

    def _sink_infer(self, batch: Batch, inputs: dict) -> list:
        stage = self.handle.stage
        stage.module.train(False)
        with torch.no_grad():
            results = stage.infer(batch, inputs)
        if len(results) != batch.ids.shape[0]:
            raise StageError(f"{type(stage).__name__}.infer returned {len(results)} results for "
                             f"{batch.ids.shape[0]} examples")
        return list(results)
