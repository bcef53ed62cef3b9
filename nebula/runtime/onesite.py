"""All stages of a job in one process, joined by in-process channels: training on one site.

This is the paper's intra-cluster phase (§4.3): its checkpoints hot-start the cross-site job, since
both use the same stage code and checkpoint format; only the channel differs. Each stage runs as
one rank here (a stage with `ranks = N` reaches the same result up to float error).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from nebula.errors import ConfigError, StageError
from nebula.runtime.service import build_stage, make_runner
from nebula.transport.inproc import InProcHub

STOP_S = 60.0  # how long a failed run waits for its other stages to end (each finishes the op it is in)


def run_one_site(job: Any, workdir: Path, quiet: bool = False, timeout: float | None = None,
                 until: int | None = None) -> None:
    """Train `job` on one site; with `until`, only its first `until` steps (the intra-cluster phase of a
    longer job): the stages are built from the whole job, so a learning-rate schedule spans all its
    steps and the cross-site run that hot-starts from step `until` continues it without a jump."""
    hub = InProcHub()
    phase = _phase(job, until)
    errors: dict[str, BaseException] = {}
    every = job.instances()  # with [replicas], each replica's stages: one graph each, in this process too
    channels = {name: hub.channel(stage.address) for name, stage in every.items()}
    # built one after the other: each seeds torch's global generator before it initialises
    stages = {}
    for name in every:
        view, stage_name = job.for_instance(name)
        stages[name] = build_stage(view, stage_name, Path(workdir) / name, quiet=quiet)

    def run(name: str) -> None:
        try:
            view, stage_name = phase.for_instance(name)
            runner = make_runner(view, stage_name, stages[name], channels[name])
            try:
                runner.run()
            finally:
                runner.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with the stage's name
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(name,), name=f"stage-{name}", daemon=True) for name in every]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    while any(t.is_alive() for t in threads) and not errors and time.monotonic() < deadline:
        threads[0].join(0.2)  # a failed stage ends the run at once: its peers would only wait for it
    if errors:  # the first failure is the first entry; the others' come from what follows
        for channel in channels.values():
            channel.close()  # the other stages' receives and sends raise: they end instead of waiting for it
        stop = time.monotonic() + STOP_S  # ...once out of the torch op each may be in: exiting under one
        for thread in threads:  # aborts the process (std::terminate, exit code 134 instead of the error's)
            thread.join(max(0.0, stop - time.monotonic()))
        name, exc = next(iter(errors.items()))
        raise StageError(f"stage {name} failed on the single site: {exc}") from exc
    if any(thread.is_alive() for thread in threads):
        raise StageError(f"single-site run did not finish within {timeout} s")


def _phase(job: Any, until: int | None) -> Any:
    """The job the runners train: `job` stopped after step `until` (a checkpoint is saved there)."""
    if until is None or until == job.train.steps:
        return job
    if not 1 <= until < job.train.steps:
        raise ConfigError(f"a one-site phase of {until} steps: must be 1 to {job.train.steps - 1} "
                          f"(the job has {job.train.steps} steps)")
    return dataclasses.replace(job, train=dataclasses.replace(job.train, steps=until))
