"""`nebula stage run`: one stage as a service of its site. Everything the stage needs from the site is
resolved here, once, and handed down: its data access (the site's grants, for the job's principal), its
channel (through the site's gateway, with its own credentials), its status and metrics watch. The
runtime (nebula.runtime.service) builds and runs the stage with what it is given; it reads no site config.

A stage with `ranks = N` is N processes started with torchrun's conventions (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `torchrun` itself can launch them; rank 0 opens the stage's
channel, the other ranks only talk to rank 0 (nebula.runtime.ranks).
"""
from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

from nebula.errors import ConfigError, NebulaError, StageError
from nebula.runtime.job import JobConfig
from nebula.runtime.metrics import WatchFactory
from nebula.runtime.ranks import RankGroup
from nebula.runtime.service import build_stage, make_runner, torchrun_env
from nebula.security.grants import DataAccess, Principal
from nebula.site.channel import open_channel
from nebula.site.config import load_site_config


def run_stage(job: JobConfig, name: str, workdir: Path, site_path: Path, quiet: bool = False, *,
              principal: Principal | None = None, observe: WatchFactory | None = None) -> None:
    """`nebula stage run`: this process's rank of stage `name` (with [replicas]: of a replica's instance,
    e.g. `first-r1`), until the job is done. `principal`: the job it runs for, as its entry point was told;
    `observe`: how rank 0 gets its watch (status, metrics).

    An exception that is no NebulaError comes from the stage's own code (its forward, its loss, its data)
    or from a library it calls: the same inputs fail the same way, so it is a StageError (exit 3, not
    restarted) with its traceback in the log, where it was a crash restarted five times before."""
    try:
        _run(job, name, workdir, site_path, quiet, principal, observe)
    except NebulaError:
        raise
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)  # the stage's log: where the bug is
        raise StageError(f"stage {name} failed in its own code: {type(exc).__name__}: {exc} (traceback above in "
                         "this log); fix it, then start the job's stages again") from exc


def _run(job: JobConfig, name: str, workdir: Path, site_path: Path, quiet: bool, principal: Principal | None,
         observe: WatchFactory | None) -> None:
    job, name = job.for_instance(name)  # the job as the instance's replica runs it
    if principal is not None and principal.job:
        # A submitted job's messages carry its id, which every site's half shares (`job submit --join`):
        # a stage refuses messages of another job, such as a half submitted under another id.
        job = dataclasses.replace(job, name=principal.job)
    config = job.stage(name)
    if config.auto_ranks:
        raise ConfigError(f"stage {name} has ranks = \"auto\": resolve it first with `nebula stage resolve --job "
                          f"{job.source} --out RESOLVED.toml` (it measures the stages) and start every site's "
                          "stages from the resolved file")
    rank, world, local_rank = torchrun_env()
    if world != config.ranks:
        raise ConfigError(f"stage {name} has ranks = {config.ranks} but WORLD_SIZE is {world}: start it with "
                          f"`torchrun --nproc-per-node {config.ranks} -m nebula.cli stage run ...` (or "
                          "nebula's launcher), or change [stages.{name}].ranks")
    site = load_site_config(site_path)  # fails before any model loads; every rank opens its data through it
    access = DataAccess(site, principal)
    label = name if world == 1 else f"{name}/{rank}"
    watch = observe(label, config.address, Path(workdir)) if observe is not None and rank == 0 else None
    stage = build_stage(job, name, workdir, quiet, rank, world, local_rank, access=access, watch=watch)
    ranks = None
    if world > 1:
        ranks = RankGroup.join(job, name, stage, rank, world)
        if rank != 0:
            ranks.serve()
            return
    try:
        # Only the stages it works with may write to it: a stranger's message, or silence, never fails it.
        peers = {job.stage(peer).address for peer in job.graph.peers(name)}
        # the other replicas' instances of this stage: their silence never fails it (nebula.runtime.replicas)
        loose = job.replicas.peers(job.replica, name).values() if job.replicas is not None else ()
        with open_channel(site, config.address, peers=peers, loose=loose) as opened, \
                stage.context.metrics.watching(opened) as channel:
            runner = make_runner(job, name, stage, channel, ranks)
            try:
                runner.run()
            finally:
                runner.close()
    finally:
        if ranks is not None:
            ranks.close()
