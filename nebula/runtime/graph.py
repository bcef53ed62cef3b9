"""The job's graph of stages: who feeds whom, which links carry gradients back, and what a step is.

Stages are nodes, links are directed edges (`from` -> `to`); a link is one-way (activations only)
or two-way (`backward = true`: gradients of its floating-point tensors come back). The graph must be
acyclic. A stage no link feeds is a *source*: it reads its own data and follows the example order
(nebula.runtime.order). A stage that feeds no link is a *sink*. Every stage processes, per step,
the micro-batches its in-links bring, one `forward` per arriving micro-batch (several in-links are
merged, as in the paper's M3 where generators of several language groups teach one
discriminator); a source processes `[train] micro_batches` of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from nebula.codecs.policy import CompressionPolicy
from nebula.errors import ConfigError, StageError
from nebula.runtime.stage import FLOAT, Stage


@dataclass(frozen=True)
class LinkConfig:
    src: str  # stage names
    dst: str
    tensors: tuple[str, ...]  # the src's output ports it carries (= dst's input ports)
    backward: bool  # two-way: gradients of its float tensors return
    compression: CompressionPolicy  # which codec each direction sends, by training step

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Item:
    """One micro-batch a stage processes in a step, in the stage's canonical order."""

    index: int  # position in the step (the micro_batch number on the stage's out-links)
    link: LinkConfig | None  # where its inputs come from (None at a source)
    micro_batch: int  # its number on that in-link


class Graph:
    def __init__(self, stages: Sequence[str], links: Sequence[LinkConfig], micro_batches: int, where: str = "job"):
        self.stages, self.links, self.where = list(stages), tuple(links), where
        self.in_links: dict[str, list[LinkConfig]] = {s: [] for s in self.stages}
        self.out_links: dict[str, list[LinkConfig]] = {s: [] for s in self.stages}
        seen = set()
        for i, link in enumerate(self.links):
            at = f"{where}: [[links]] #{i + 1} ({link.name})"
            for end in (link.src, link.dst):
                if end not in self.in_links:
                    raise ConfigError(f"{at}: no stage {end!r}; stages: {', '.join(self.stages)}")
            if link.src == link.dst:
                raise ConfigError(f"{at}: a link joins two different stages")
            if (link.src, link.dst) in seen:
                raise ConfigError(f"{at}: a second link {link.name}; list every tensor in one link")
            seen.add((link.src, link.dst))
            self.out_links[link.src].append(link)
            self.in_links[link.dst].append(link)
        self.links_by_name = {link.name: link for link in self.links}
        self.order = self._topological()
        self.sources = [s for s in self.order if not self.in_links[s]]
        self.sinks = [s for s in self.order if not self.out_links[s]]
        self._items: dict[str, list[Item]] = {}
        for stage in self.order:  # upstream first: a stage's count depends on its feeders'
            self._items[stage] = self._canonical(stage, micro_batches)

    @property
    def coordinator(self) -> str:
        """The stage that coordinates resumes and the end of the job: the first in the job file."""
        return self.stages[0]

    def link(self, name: str) -> LinkConfig:
        if name in self.links_by_name:
            return self.links_by_name[name]
        names = ", ".join(link.name for link in self.links) or "none"
        raise ConfigError(f"{self.where}: no link {name!r}; links: {names}")

    def items(self, stage: str) -> list[Item]:
        return self._items[stage]

    def per_step(self, stage: str) -> int:
        return len(self._items[stage])

    def waits_for_gradients(self, stage: str) -> bool:
        return any(link.backward for link in self.out_links[stage])

    def paths(self, origin: str, sink: str) -> int:
        """How many distinct paths lead from `origin` to `sink` (one inference end marker arrives per path)."""
        if origin == sink:
            return 1
        return sum(self.paths(link.dst, sink) for link in self.out_links[origin])

    def reachable_sinks(self, origin: str) -> list[str]:
        return [s for s in self.sinks if self.paths(origin, s)]

    def peers(self, stage: str) -> set[str]:
        """The stages `stage` exchanges messages with, so the only ones its channel hears (a message
        from any other is refused): the other ends of its links, the coordinator (which talks to
        every stage), and the sources and sinks a path joins it to (a sink sends its inference
        scores back to the source that asked)."""
        if stage == self.coordinator:
            return set(self.stages) - {stage}
        found = {link.dst for link in self.out_links[stage]} | {link.src for link in self.in_links[stage]}
        if stage in self.sources:
            found |= set(self.reachable_sinks(stage))
        if stage in self.sinks:
            found |= {s for s in self.sources if self.paths(s, stage)}
        return (found | {self.coordinator}) - {stage}

    def _topological(self) -> list[str]:
        indegree = {s: len(self.in_links[s]) for s in self.stages}
        order, ready = [], [s for s in self.stages if not indegree[s]]
        while ready:
            stage = ready.pop(0)
            order.append(stage)
            for link in self.out_links[stage]:
                indegree[link.dst] -= 1
                if not indegree[link.dst]:
                    ready.append(link.dst)
        if len(order) != len(self.stages):
            cycle = sorted(s for s in self.stages if s not in order)
            raise ConfigError(f"{self.where}: the links form a cycle through {', '.join(cycle)}; a job graph "
                              "must be acyclic (gradients flow back on two-way links, not on links of their own)")
        return order

    def _canonical(self, stage: str, micro_batches: int) -> list[Item]:
        """Micro-batch m of each in-link, ordered by (m, in-link): processing them in this fixed order
        makes a stage's results independent of arrival order."""
        links = self.in_links[stage]
        if not links:
            return [Item(m, None, m) for m in range(micro_batches)]
        pairs = sorted((m, i) for i, link in enumerate(links) for m in range(self.per_step(link.src)))
        return [Item(k, links[i], m) for k, (m, i) in enumerate(pairs)]


def check_ports(graph: Graph, classes: Mapping[str, Any], job: Any) -> None:
    """Every link carries tensors its ends declare (`Stage.ports(job, name)`), with the same dtype and rank
    (and sizes, where both declare them for the stages' options); every required input is fed; a source
    reads data."""
    options = {name: stage.options for name, stage in job.stages.items()}
    where = graph.where
    ports = {name: cls.ports(job, name) for name, cls in classes.items()}  # (inputs, outputs)
    for link in graph.links:
        at = f"{where}: [[links]] {link.name}"
        src, dst = classes[link.src], classes[link.dst]
        outs, ins = {p.name: p for p in ports[link.src][1]}, {p.name: p for p in ports[link.dst][0]}
        if not link.tensors:
            raise ConfigError(f"{at}: `tensors` is empty; {link.src} can send {', '.join(outs) or 'nothing'}")
        for name in link.tensors:
            if name not in outs:
                raise ConfigError(f"{at}: stage {link.src} ({src.stage_name or src.__name__}) has no output "
                                  f"{name!r}; its outputs: {', '.join(outs) or 'none'}")
            if name not in ins:
                raise ConfigError(f"{at}: stage {link.dst} ({dst.stage_name or dst.__name__}) has no input "
                                  f"{name!r}; its inputs: {', '.join(ins) or 'none'}")
            if (outs[name].dtype, outs[name].rank) != (ins[name].dtype, ins[name].rank):
                raise ConfigError(f"{at}: {name!r} is {outs[name].dtype} of rank {outs[name].rank} at "
                                  f"{link.src} but {ins[name].dtype} of rank {ins[name].rank} at {link.dst}")
            _check_sizes(at, name, (link.src, outs[name], options[link.src]),
                         (link.dst, ins[name], options[link.dst]))
        missing = [p.name for p in ins.values() if not p.optional and p.name not in link.tensors]
        if missing:
            raise ConfigError(f"{at}: {link.dst} needs {', '.join(missing)} from every link that feeds it; "
                              f"add them to `tensors`")
        if link.backward and not any(outs[n].dtype == FLOAT for n in link.tensors):
            raise ConfigError(f"{at}: backward = true, but no floating-point tensor to return gradients for")
    for stage in graph.sources:
        needed = [p.name for p in ports[stage][0] if not p.optional]
        if needed:  # no link feeds it: its forward would find no input (a bare KeyError at step 1 before)
            raise ConfigError(f"{where}: stage {stage} ({classes[stage].__name__}) needs input "
                              f"{', '.join(map(repr, needed))}, but no link feeds it; add a [[links]] entry with "
                              f"to = \"{stage}\" and tensors = {needed}")
        if classes[stage].examples is Stage.examples:
            raise ConfigError(f"{where}: stage {stage} is fed by no link, so it reads data, but "
                              f"{classes[stage].__name__} has no examples(split); link a stage to it")


def _check_sizes(at: str, name: str, sender: tuple[str, Any, Any], receiver: tuple[str, Any, Any]) -> None:
    """Where both ends of a link declare a tensor's sizes, they must agree: a ConfigError naming both."""
    (src, out, src_options), (dst, inp, dst_options) = sender, receiver
    try:
        sent, taken = out.dims(src_options), inp.dims(dst_options)
    except StageError as exc:
        raise ConfigError(f"{at}: {exc}") from exc
    if sent is None or taken is None:
        return
    if any(a is not None and b is not None and a != b for a, b in zip(sent, taken)):
        raise ConfigError(f"{at}: {name!r} is {shape_text(sent)} at {src} but {dst} takes {shape_text(taken)}; "
                          "make the stages' options agree (e.g. the same width at both)")


def shape_text(dims: tuple[int | None, ...]) -> str:
    """(B, 16, *): the batch, then each size (* for any)."""
    return "(" + ", ".join(["B", *("*" if d is None else str(d) for d in dims)]) + ")"
