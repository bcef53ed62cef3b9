"""Inference passes through the graph: a source sends the batches of a split along its out-links,
every stage on the way forwards them without gradients, and each sink runs its `infer` and, at the
end marker, its `score`, which goes back to the source that asked.

Inference messages and end markers are handled in arrival order, each once the stage's weights are
at least those of the step the source evaluates, so an evaluation after training uses every
stage's final weights even where a forward-only link lets a receiver lag.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

from nebula.errors import StageError
from nebula.runtime import control as ctl
from nebula.runtime.graph import LinkConfig
from nebula.runtime.order import id_hashes
from nebula.runtime.stage import Batch
from nebula.wire import Message


class InferencePasses:
    """Mixed into StageRunner (which holds the links, the executor and the sender)."""

    def init_inference(self) -> None:
        self.inference: deque = deque()  # (message, link, inputs, ids, topic or end marker), arrival order
        self.results: dict[tuple[str, str], list] = {}  # sink: (origin, split) -> results so far
        self.ends: dict[tuple[str, str], int] = {}  # sink: end markers seen per pass
        self.asked: dict[str, dict[str, Any]] = {}  # origin: split -> sink -> scores
        self._asking = (0, 1)  # origin: (examples, batch size) of the pass in progress
        self._hashes: dict[str, torch.Tensor] = {}  # split -> example-id hashes (sources)

    def evaluate(self, split: str, indices: list[int], batch_size: int) -> dict[str, Any]:
        """Inference from this source on examples `indices` of `split`: its outputs travel the links
        (with their codecs) to the sinks, which run their `infer` and `score`; -> {sink: scores}."""
        topic, hashes = ctl.infer_topic(self.name, split), self._example_hashes(split)
        sinks = self.graph.reachable_sinks(self.name)
        self.asked[split], self._asking, local = {}, (len(indices), batch_size), []
        for b, start in enumerate(range(0, len(indices), batch_size)):
            chosen = indices[start:start + batch_size]
            batch = Batch(split, self.step, b, ids=hashes[chosen], training=False, indices=chosen)
            if not self.out_links:  # a one-stage job: this stage is its own sink
                local += self._sink_infer(batch, {})
                continue
            out = self.executor.infer_forward(batch, {})
            for link in self.out_links:
                self._emit("forward", link, self.step, b, {n: out.tensors[n] for n in link.tensors}, batch.ids, topic)
        if not self.out_links:
            return {self.name: self.stage.score(split, local)}
        for link in self.out_links:
            self._tell(link.dst, ctl.InferEnd(origin=self.name, split=split))
        self.pump(lambda: set(self.asked[split]) >= set(sinks))
        return self.asked.pop(split)

    def _infer(self, msg: Message, link: LinkConfig, inputs: dict | None, ids: Any, what: Any) -> None:
        """One inference batch, or the end of a pass, in arrival order, once this stage's weights are
        at least those of the step the origin evaluates."""
        if isinstance(what, ctl.InferEnd):
            if self.out_links:
                for out in self.out_links:
                    self._tell(out.dst, what, step=msg.step)
                return
            key = (what.origin, what.split)
            self.ends[key] = self.ends.get(key, 0) + 1
            if self.ends[key] == self.graph.paths(what.origin, self.name):
                scores = self.stage.score(what.split, self.results.pop(key, []))
                del self.ends[key]
                self._tell(what.origin, ctl.Scores(split=what.split, sink=self.name, scores=scores), step=msg.step)
            return
        batch = Batch(what.split, msg.step, msg.micro_batch, ids=ids, training=False, link=link.name)
        if self.out_links:
            out = self.executor.infer_forward(batch, inputs)
            for out_link in self.out_links:
                self._emit("forward", out_link, msg.step, msg.micro_batch,
                           {n: out.tensors[n] for n in out_link.tensors}, ids, what)
            return
        results = self.results.setdefault((what.origin, what.split), [])
        results += self._sink_infer(batch, inputs)
        # the origin hears that decoding goes on: a long evaluation is progress, not a silent peer
        self._tell(what.origin, ctl.InferProgress(split=what.split, n=len(results)), step=msg.step)

    def _sink_infer(self, batch: Batch, inputs: dict) -> list:
        self.stage.module.train(False)
        with torch.no_grad():
            results = self.stage.infer(batch, inputs)
        if len(results) != batch.ids.shape[0]:
            raise StageError(f"{type(self.stage).__name__}.infer returned {len(results)} results for "
                             f"{batch.ids.shape[0]} examples")
        return list(results)

    def forget_examples(self, split: str) -> None:
        """The source's `split` changed (e.g. `nebula translate`'s next input): read its ids again."""
        self._hashes.pop(split, None)

    def _example_hashes(self, split: str) -> torch.Tensor:
        if split not in self._hashes:
            self._hashes[split] = id_hashes(self.stage.examples(split))
        return self._hashes[split]
