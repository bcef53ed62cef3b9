"""`ranks = "auto"`: a stage's data-parallel width chosen from measured step times (paper §3.3).

The paper assigns each generator n sub-discriminators, "n estimated based on the practical
performance test on each cluster" (it set n = 8 by hand). Here the stage module measures: its class
implements `choose_ranks(job, name, most) -> (n, evidence)`, timing a few warm-up micro-batches of
the stages that feed it and of one rank of itself on this machine. The launcher resolves the job
before any service starts and every site runs the resolved file, so all agree on n without talking.

n also scales the step, as in the paper ("G first performs n forward computations and produces n
results"): a job's [train] batch_size and micro_batches are those of one rank, multiplied by n.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from nebula.errors import ConfigError
from nebula.runtime.job import JobConfig, TrainConfig, load_job
from nebula.runtime.job_file import override, read_job_table, write_job_file
from nebula.runtime.registry import resolve_stage


def scale_step(train: dict, n: int) -> None:
    """A raw [train] table's batch_size and micro_batches, given for one rank, made those of n ranks
    (an omitted one is TrainConfig's default, as the job would have read it)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key in ("batch_size", "micro_batches"):
        train[key] = n * train.get(key, defaults[key])


def auto_stages(job: JobConfig) -> list[str]:
    return [name for name, stage in job.stages.items() if stage.auto_ranks]


def resolve(job_file: Path, out: Path, quiet: bool = False) -> tuple[Path, dict[str, Any]]:
    """Write `out`: `job_file` with every ranks = "auto" replaced by the measured n (the original
    is returned unchanged if it has none). -> (the file to run, {stage: evidence})."""
    job = load_job(job_file)
    names = auto_stages(job)
    if not names:
        return Path(job_file), {}
    if len(names) > 1:
        raise ConfigError(f"{job_file}: stages {', '.join(names)} all have ranks = \"auto\"; at most one may "
                          "(n scales the whole step); fix the others' ranks")
    name = names[0]
    cls = resolve_stage(job.stage(name).impl)
    if not hasattr(cls, "choose_ranks"):
        raise ConfigError(f"{job_file}: [stages.{name}] ranks = \"auto\", but {cls.__name__} cannot measure "
                          "its ranks (no choose_ranks): set ranks = N")
    n, evidence = cls.choose_ranks(job, name, job.stage(name).max_ranks)
    table = read_job_table(job_file)  # [job].data absolute: the resolved file lives elsewhere
    train = dict(table.get("train", {}))
    scale_step(train, n)
    evidence = {"stage": name, "ranks": n, **evidence}
    write_job_file(out, override(table, train=train, stages={name: {"ranks": n}}),
                   note=f"{job_file} with [stages.{name}] ranks = \"auto\" resolved: {json.dumps(evidence)}")
    if not quiet:
        print(f"ranks = \"auto\" for stage {name}: n = {n} ({json.dumps(evidence)})", file=sys.stderr, flush=True)
    return out, {name: evidence}
