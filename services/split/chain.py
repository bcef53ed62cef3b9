"""Is the job's split of the model one model? Checked before any weight is built, over the whole job file,
so a bad split fails every stage alike with a ConfigError naming what to fix (`nebula stage run` exits 3).

- The split stages (those with SplitOptions) name the same model, data and loss.
- Their `part`s are 0 .. len(points) once each.
- A two-way link joins part k to part k + 1 for every k; no other link joins two of them.

Also where the split's ports come from: the model traced on the "meta" device (shapes, no values), once
per process and model, since the job loader asks for every stage's ports.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nebula.errors import ConfigError
from services.split.cut import Boundary, split
from services.split.data import example_inputs
from services.split.model import build_model
from services.split.options import SplitOptions

SHARED = ("model", "data", "loss")  # what every split stage of a job must agree on


def micro_batch(job: Any) -> int:
    """Examples per micro-batch: the batch every part is traced for."""
    return job.train.batch_size // job.train.micro_batches


def base_dir(job: Any) -> Path | None:
    """Where a job's relative model and tokenizer files are: beside the job file."""
    return Path(job.source).resolve().parent if job.source is not None else None


def check_chain(job: Any) -> list[str]:
    """The split stages of `job` in part order, or a ConfigError."""
    stages = {name: s.options for name, s in job.stages.items() if isinstance(s.options, SplitOptions)}
    if not stages:
        raise ConfigError(f"job {job.name} has no split stage (impl = \"split\")")
    head = next(iter(stages))
    for name, options in stages.items():
        for key in SHARED:
            if getattr(options, key) != getattr(stages[head], key):
                raise ConfigError(f"[stages.{name}].{key} differs from [stages.{head}].{key}: every split stage "
                                  f"names the same {key} (copy it)")
    parts = len(stages[head].model.points) + 1
    by_part: dict[int, str] = {}
    for name, options in stages.items():
        if options.part >= parts:
            raise ConfigError(f"[stages.{name}].part = {options.part}: {parts} split points make {parts} parts, "
                              f"0 to {parts - 1}")
        if options.part in by_part:
            raise ConfigError(f"[stages.{name}] and [stages.{by_part[options.part]}] both hold part {options.part}")
        by_part[options.part] = name
    missing = sorted(set(range(parts)) - set(by_part))
    if missing:
        raise ConfigError(f"no stage holds part {missing[0]} of the {parts} the split points make: add a stage "
                          f"with part = {missing[0]}, or drop a point")
    chain = [by_part[k] for k in range(parts)]
    _check_links(job, chain)
    return chain


def _check_links(job: Any, chain: list[str]) -> None:
    links = {(link.src, link.dst): link for link in job.links}
    for a, b in zip(chain, chain[1:]):
        link = links.get((a, b))
        if link is None:
            tensors = ", ".join(f'"{t.name}"' for t in boundaries(job.stage(b).options, job)[0])
            raise ConfigError(f"no link from {a} (part {chain.index(a)}) to {b} (part {chain.index(b)}): add "
                              f"[[links]] from = \"{a}\", to = \"{b}\", tensors = [{tensors}] (what crosses that "
                              "cut), backward = true")
        if not link.backward:
            raise ConfigError(f"[[links]] {a}->{b}: backward = false, but the parts train as one model: the "
                              "gradients must come back (backward = true)")
    adjacent = set(zip(chain, chain[1:]))
    for src, dst in links:
        if src in chain and dst in chain and (src, dst) not in adjacent:
            raise ConfigError(f"[[links]] {src}->{dst} joins parts {chain.index(src)} and {chain.index(dst)}, "
                              "which are not neighbours: a split model is a chain, part k to part k + 1 (tensors "
                              "used further on are relayed by the parts between)")


def boundaries(options: SplitOptions, job: Any) -> tuple[tuple[Boundary, ...], tuple[Boundary, ...]]:
    """(received, sent) boundary tensors of the part `options` names."""
    if not options.model.points:  # the whole model, one part: nothing crosses a cut (and no trace at load: the
        return (), ()             # stage traces it when it builds; a replicated whole model loads 2-3 s sooner)
    base, batch = base_dir(job), micro_batch(job)
    key = json.dumps([dataclasses.asdict(options.model), dataclasses.asdict(options.data), str(base), batch],
                     sort_keys=True)
    if key not in _TRACED:
        # shapes without values on "meta"; but a model torch.export cannot trace may branch on its values, so
        # the sequential fallback runs its children on real zeros
        device = "cpu" if options.model.splitter == "sequential" else "meta"
        model = build_model(options.model, base, device)
        parts = split(model, example_inputs(options.data, batch, device), options.model.points,
                      options.model.splitter)
        _TRACED[key] = [(part.receives, part.sends) for part in parts]
    found = _TRACED[key]
    if options.part >= len(found):
        raise ConfigError(f"part = {options.part}: {len(found) - 1} split points make {len(found)} parts, "
                          f"0 to {len(found) - 1}")
    return found[options.part]


_TRACED: dict[str, list[tuple[tuple[Boundary, ...], tuple[Boundary, ...]]]] = {}  # one trace per model a process
