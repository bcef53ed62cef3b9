"""Helpers for the runtime's tests: jobs of the example workload (services/example) built in code,
stages that misbehave in one way (hivemind-style fault injection), and runners on in-process
channels in threads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula.errors import DataError
from nebula.runtime.job import parse_job
from nebula.runtime.job_digest import SITE_LOCAL
from nebula.runtime.service import build_stage, make_runner
from nebula.runtime.stage import FLOAT, Output, Port, Stage
from services.example.stages import Options, Sink, Source

TIMELINE: list[tuple[float, str, int]] = []  # (time, event, step) from the instrumented stages below


def example_job(stages: int = 2, schedule: str = "synchronous", backward: bool = True, steps: int = 12,
                credit: int | None = None, compression: dict | None = None, local_loss: bool = False,
                sink_impl: str = "example-sink", sink_options: dict | None = None, source_impl: str = "example-source",
                source_options: dict | None = None, integrity: dict | None = None,
                checkpoint_every: int = 3, micro_batches: int = 4, sink_ranks: int = 1,
                schedule_options: dict | None = None):
    """A chain source -> [middle ->] sink on sites a, b[, c] of the example workload; stages="fan-out":
    one source feeding two sinks (src -> sink at b, src -> side at c)."""
    names = {2: ["src", "sink"], 3: ["src", "mid", "sink"], "fan-out": ["src", "sink", "side"]}[stages]
    impls = {"src": source_impl, "mid": "example-middle", "sink": sink_impl, "side": "example-sink"}
    sites = dict(zip(names, "abc"))
    pairs = [("src", "sink"), ("src", "side")] if stages == "fan-out" else list(zip(names, names[1:]))
    raw = {"job": {"name": "t"},
           "train": {"steps": steps, "batch_size": 16, "micro_batches": micro_batches,
                     "checkpoint_every": checkpoint_every, "log_every": 1},
           "schedule": {"name": schedule, **({"credit": credit} if credit else {}), **(schedule_options or {})},
           "stages": {n: {"address": f"{sites[n]}/{n}/0", "impl": impls[n]} for n in names},
           "links": [{"from": a, "to": b, "tensors": ["hidden"], "backward": backward,
                      **({"compression": compression} if compression else {})} for a, b in pairs]}
    if local_loss:
        raw["stages"]["src"]["local_loss"] = True
    raw["stages"]["sink"].update(sink_options or {})
    raw["stages"]["src"].update(source_options or {})
    if integrity:
        raw["integrity"] = integrity
    if sink_ranks > 1:
        raw["stages"]["sink"]["ranks"] = sink_ranks
    return parse_job(raw)


@dataclass
class Running:
    """Runners of a job's stages in threads over one in-process hub."""

    job: object
    root: Path
    hub: object
    runners: dict = field(default_factory=dict)
    threads: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    recv_timeout: float = 20.0  # each runner's wait for its next message

    def start(self, name: str, job=None, channel=None) -> None:
        job = job or self.job
        stage = build_stage(job, name, self.root / name, quiet=True)
        channel = channel or self.hub.channel(job.stage(name).address)
        runner = self.runners[name] = make_runner(job, name, stage, channel, timeout=self.recv_timeout)
        self.threads[name] = in_thread(runner, name, self.errors)

    def join(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for name, thread in self.threads.items():
            thread.join(max(0.1, deadline - time.monotonic()))
            assert not thread.is_alive(), f"stage {name} did not finish; errors: {self.errors}"
        assert not self.errors, f"stages failed: {self.errors}"

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.runners[name].stage.trainable().items()}


def in_thread(runner, name: str, errors: dict) -> threading.Thread:
    """`runner.run()` in a started daemon thread; whatever it raises (KeyboardInterrupt too: a process
    'dying') goes to errors[name], for the test."""
    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[name] = exc
        finally:
            runner.close()
    thread = threading.Thread(target=run, name=f"test-{name}", daemon=True)
    thread.start()
    return thread


def run_job(job, root: Path, crash: str | None = None, crashed_job=None, timeout: float = 30.0) -> Running:
    """Every stage of `job`; with `crash`, that stage runs `crashed_job` (one that crashes), is
    restarted with `job` when it dies, and the run goes on."""
    from nebula.transport.inproc import InProcHub
    running = Running(job, root, InProcHub())
    channels = {name: running.hub.channel(job.stage(name).address) for name in job.stages}  # all addresses first
    for name in job.stages:
        running.start(name, crashed_job if name == crash else None, channels[name])
    if crash:
        running.threads[crash].join(timeout)
        assert isinstance(running.errors.pop(crash, None), KeyboardInterrupt), running.errors
        running.start(crash, channel=running.hub.restart(job.stage(crash).address))
    running.join(timeout)
    return running


@dataclass(frozen=True, kw_only=True)
class CrashOptions(Options):
    # faults injected into one incarnation of a stage: not the job's definition, which the restart shares
    crash_at: int = field(default=0, metadata=SITE_LOCAL)  # die (as a killed process would) in the middle of this step
    slow_infer: float = field(default=0.0, metadata=SITE_LOCAL)  # seconds per inference batch
    slow_apply: float = field(default=0.01, metadata=SITE_LOCAL)  # seconds per optimiser step


class CrashingSink(Sink):
    Options = CrashOptions

    def optimizer_step(self, step: int) -> None:
        if step == self.options.crash_at:
            raise KeyboardInterrupt("injected crash")  # a process dying, not an error it handles
        TIMELINE.append((time.monotonic(), "sink-applied", step))
        time.sleep(self.options.slow_apply)  # a receiver slower than its sender: the pace credit must hold it back
        super().optimizer_step(step)

    def infer(self, batch, inputs):
        time.sleep(self.options.slow_infer)
        return super().infer(batch, inputs)


class NormedSink(CrashingSink):
    """The example sink behind a BatchNorm: its running statistics are state that is not a weight."""

    def __init__(self, context, options):
        super().__init__(context, options)
        self.module = torch.nn.Sequential(torch.nn.BatchNorm1d(options.width), torch.nn.Linear(options.width, 1))
        self._optimise()


class BadDataSink(Sink):
    """Rank 1 of the stage meets bad data at step 3."""

    def forward(self, batch, inputs):
        if self.context.rank == 1 and batch.step == 3:
            raise DataError("bad example on rank 1 at step 3")
        return super().forward(batch, inputs)


class TimedSource(Source):
    def forward(self, batch, inputs):
        if batch.training and batch.micro_batch == 0:
            TIMELINE.append((time.monotonic(), "source-opened", batch.step))
        return super().forward(batch, inputs)


@dataclass(frozen=True, kw_only=True)
class PacedOptions(Options):
    pace_s: float = 0.05  # seconds each training micro-batch's forward takes, asleep


class _Paced:
    """Each training micro-batch's forward takes `pace_s` more (asleep): a step of compute a link's wire can
    hide under, or a test can kill a stage in, as a real model's would (the example's own layers take
    microseconds)."""

    Options = PacedOptions

    def forward(self, batch, inputs):
        if batch.training:
            time.sleep(self.options.pace_s)
        return super().forward(batch, inputs)


class PacedSource(_Paced, Source):
    pass


class PacedSink(_Paced, Sink):
    pass


class IntHiddenSource(PacedSource):
    """A broken source: its forward returns an integer `hidden` where its port declares floating point."""

    def forward(self, batch, inputs):
        out = super().forward(batch, inputs)
        return Output(tensors={"hidden": out.tensors["hidden"].long()}, loss=out.loss)  # (B, width), wrong dtype


class NoData(Stage):
    """A stage that computes but reads no data of its own: it cannot be a source."""

    outputs = (Port("hidden", FLOAT, rank=2),)

    def forward(self, batch, inputs):
        return Output(tensors={"hidden": torch.zeros(len(batch.ids), 16)})
