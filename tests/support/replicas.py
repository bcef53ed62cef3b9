"""Helpers for the replicas' tests: the example workload's chain replicated (built in code), its instances
run as runners in threads over one in-process hub, and a one-process reference of what the replicas and
their outer optimiser must compute (torch.optim.SGD with Nesterov momentum as the outer step)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula.runtime.job import parse_job
from nebula.runtime.order import ExampleOrder, id_hashes
from nebula.runtime.outer import split_fragments
from nebula.runtime.service import build_stage, make_runner
from nebula.runtime.stage import Batch
from nebula.transport.inproc import InProcHub
from tests.support.runtime import CrashingSink, CrashOptions, in_thread


def replica_job(replicas: dict | None = None, stages: int = 2, steps: int = 12, checkpoint_every: int = 3,
                micro_batches: int = 2, schedule: str = "synchronous", sink_impl: str = "example-sink",
                sink_options: dict | None = None, ranks: int = 1, raw: bool = False):
    """The example chain src -> [mid ->] sink on sites a, b[, c], replicated per `replicas` (default: two
    replicas at sites d, e[, f], H = 4, no codec; a deadline that a test of a killed replica waits out)."""
    names = ["src", "mid", "sink"] if stages == 3 else ["src", "sink"]
    impls = {"src": "example-source", "mid": "example-middle", "sink": sink_impl}
    sites = dict(zip(names, "abc"))
    table = {"groups": [list("abc"[:stages]), list("def"[:stages])], "H": 4, "deadline_s": 20.0,
             "start_timeout_s": 30.0, **(replicas or {})}
    job = {"job": {"name": "r"},
           "train": {"steps": steps, "batch_size": 8, "micro_batches": micro_batches,
                     "checkpoint_every": checkpoint_every, "log_every": 1},
           "schedule": {"name": schedule},
           "stages": {n: {"address": f"{sites[n]}/{n}/0", "impl": impls[n]} for n in names},
           "links": [{"from": a, "to": b, "tensors": ["hidden"], "backward": True} for a, b in zip(names, names[1:])],
           "replicas": table}
    job["stages"]["sink"].update(sink_options or {})
    if ranks > 1:
        job["stages"]["sink"]["ranks"] = ranks
    return job if raw else parse_job(job)


@dataclass
class Replicated:
    """Every instance of a replicated job as a runner in a thread, over one in-process hub."""

    job: object
    root: Path
    hub: InProcHub = field(default_factory=InProcHub)
    runners: dict = field(default_factory=dict)
    threads: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    channels: dict = field(default_factory=dict)

    def open(self) -> Replicated:
        for name, stage in self.job.instances().items():
            self.channels[name] = self.hub.channel(stage.address)
        return self

    def start(self, name: str, job=None, restart: bool = False) -> None:
        view, stage_name = (job or self.job).for_instance(name)
        stage = build_stage(view, stage_name, self.root / name, quiet=True)
        address = view.stage(stage_name).address
        channel = self.hub.restart(address) if restart else self.channels[name]
        runner = self.runners[name] = make_runner(view, stage_name, stage, channel, timeout=60.0)
        self.threads[name] = in_thread(runner, name, self.errors)

    def start_all(self, jobs: dict | None = None) -> Replicated:
        for name in self.job.instances():
            self.start(name, (jobs or {}).get(name))
        return self

    def join(self, timeout: float = 60.0, names=None) -> None:
        deadline = time.monotonic() + timeout
        for name in names or list(self.threads):
            self.threads[name].join(max(0.1, deadline - time.monotonic()))
            assert not self.threads[name].is_alive(), f"{name} did not finish; errors: {self.errors}"

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.runners[name].stage.trainable().items()}


def train_step(job, stages: dict, hashes: torch.Tensor, order: ExampleOrder, t: int) -> None:
    """One synchronous step of a chain of stages in one process, at their live weights."""
    graph, train = job.graph, job.train
    idx = order.indices(t)
    for m in range(train.micro_batches):
        chosen = idx[m::train.micro_batches]
        batch = Batch("train", t, m, ids=hashes[chosen], indices=chosen)
        received, sent, losses = {}, {}, []
        for name in graph.order:
            inputs = {}
            if graph.in_links[name]:
                link = graph.in_links[name][0]
                inputs = {"hidden": sent[link.src].detach().requires_grad_()}
                received[name] = inputs["hidden"]
            out = stages[name].forward(batch, inputs)
            if out.loss is not None:
                losses.append(out.loss / train.micro_batches)
            if "hidden" in out.tensors:
                sent[name] = out.tensors["hidden"]
        for loss in losses:
            loss.backward(retain_graph=True)
        for name in reversed(graph.order):
            for link in graph.out_links[name]:
                sent[name].backward(received[link.dst].grad, retain_graph=True)
    for stage in stages.values():
        stage.optimizer.step()
        stage.optimizer.zero_grad(set_to_none=True)


def reference(job, root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """What every replica must end with: each trains its shard (its own stages, seeded as the runtime seeds
    them), and at each fragment's round the mean of anchor - weights goes to torch's SGD (Nesterov) on the
    anchor; the weights then move onto the new anchor plus their progress since the send (overlap)."""
    config, train, count = job.replicas.config, job.train, job.replicas.count
    views = [job.replica_view(k) for k in range(count)]
    stages = [{n: build_stage(v, n, root / f"{n}-{k}", quiet=True) for n in job.graph.order}
              for k, v in enumerate(views)]
    hashes = id_hashes(stages[0]["src"].examples("train"))
    orders = [ExampleOrder(len(hashes), train.batch_size, train.seed, (k, count)) for k in range(count)]
    outer = {}
    for name in job.graph.order:
        params = stages[0][name].trainable()
        frags = split_fragments({n: p.numel() for n, p in params.items()}, config.fragments)
        for f, names in enumerate(frags):
            anchor = [params[n].detach().clone().requires_grad_() for n in names]
            opt = torch.optim.SGD(anchor, lr=config.outer.lr, momentum=config.outer.momentum,
                                  nesterov=config.outer.name == "nesterov")
            outer[(name, f)] = {"names": names, "anchor": anchor, "opt": opt, "sent": None, "step": None}
    for t in range(1, train.steps + 1):
        for k in range(count):
            train_step(views[k], stages[k], hashes, orders[k], t)
        for (name, f), o in outer.items():
            final = t == train.steps
            if o["sent"] is not None and (final or t >= o["step"] + config.overlap):
                _merge(o, [stages[k][name] for k in range(count)])
            if final or t % config.H == config.sync_offset(f):
                o["sent"] = [{n: s[name].trainable()[n].detach().clone() for n in o["names"]} for s in stages]
                o["step"] = t
                if config.overlap == 0 or final:
                    _merge(o, [stages[k][name] for k in range(count)])
    return {name: {n: p.detach().clone() for n, p in stages[0][name].trainable().items()} for name in job.graph.order}


def _merge(o: dict, replicas: list) -> None:
    with torch.no_grad():
        for i, n in enumerate(o["names"]):
            a = o["anchor"][i]
            a.grad = torch.stack([a.detach() - sent[n] for sent in o["sent"]]).mean(0)
    o["opt"].step()
    with torch.no_grad():
        for stage, sent in zip(replicas, o["sent"]):
            for i, n in enumerate(o["names"]):
                live = stage.trainable()[n]
                live.copy_(o["anchor"][i].detach() + (live - sent[n]))
    o["sent"] = None


@dataclass(frozen=True, kw_only=True)
class SlowCrashOptions(CrashOptions):
    pace_s: float = 0.02  # seconds each training micro-batch's forward takes, asleep


class SlowCrashingSink(CrashingSink):
    """The example sink at a pace a test can kill it in (crash_at: dies in that step's update)."""

    Options = SlowCrashOptions

    def forward(self, batch, inputs):
        if batch.training:
            time.sleep(self.options.pace_s)
        return super().forward(batch, inputs)
