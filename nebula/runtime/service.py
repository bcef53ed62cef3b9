"""One stage as a service: build it from the job file, hand it its channel, run it to the end.

`nebula stage run` lands here. A stage with `ranks = N` is N processes started with torchrun's
conventions (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `torchrun` itself can
launch them; rank 0 opens the stage's channel, the other ranks only talk to rank 0
(nebula.runtime.ranks).

What a stage may use of the world outside its maths is resolved here, once per process, and handed
to it in its StageContext: the site config, the job it runs for and so the data it may read
(`DataAccess`), and what watches it (a `Watch` from the entry point, for its status and metrics).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nebula.errors import ConfigError
from nebula.runtime.job import JobConfig
from nebula.runtime.metrics import MetricsLog, Watch, WatchFactory
from nebula.runtime.ranks import RankGroup
from nebula.runtime.registry import resolve_stage
from nebula.runtime.runner import StageRunner
from nebula.runtime.stage import Stage, StageContext
from nebula.security.grants import DataAccess, Principal
from nebula.transport.base import Channel
from nebula.transport.config import SiteConfig, load_site_config
from nebula.transport.reliable import open_channel


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`auto` -> cuda when available, else cpu; a bare `cuda` on rank r -> cuda:<local rank>."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r}: this machine has no CUDA device torch can use "
                              "(set device = \"cpu\", or install a CUDA build of torch)")
        if spec == "cuda":
            spec = f"cuda:{local_rank % torch.cuda.device_count()}"
        if int(spec.split(":")[1]) >= torch.cuda.device_count():
            raise ConfigError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device(spec)


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; (0, 1, 0) without them."""
    try:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as exc:
        raise ConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {exc}") from exc


def build_stage(job: JobConfig, name: str, workdir: Path, quiet: bool = False, rank: int = 0, world: int = 1,
                local_rank: int = 0, site: SiteConfig | None = None, *, principal: Principal | None = None,
                watch: Watch | None = None) -> Stage:
    """The stage module, seeded from [train].seed and its position in the job (ranks alike). It reads
    [job].data at `site` for `principal` (None: not a submitted job); `watch` follows rank 0's records."""
    config = job.stage(name)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device, local_rank)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    label = name if world == 1 else f"{name}/{rank}"
    metrics = MetricsLog(workdir / "metrics.jsonl" if rank == 0 else None, label, job.train.log_every, quiet=quiet,
                         tensorboard=job.train.tensorboard, watch=watch)
    torch.manual_seed(job.train.seed + list(job.stages).index(name))
    context = StageContext(name=name, address=config.address, job=job, workdir=workdir, device=device,
                           metrics=metrics, rank=rank, world_size=world, site=site,
                           access=DataAccess(site, principal))
    return resolve_stage(config.impl)(context, config.options)


def make_runner(job: JobConfig, name: str, stage: Stage, channel: Channel, ranks: RankGroup | None = None,
                timeout: float = 300.0) -> StageRunner:
    return StageRunner(job, name, stage, channel, stage.context.workdir, stage.context.metrics, ranks=ranks,
                       timeout=timeout)


def run_stage(job: JobConfig, name: str, workdir: Path, site_path: Path, quiet: bool = False, *,
              principal: Principal | None = None, observe: WatchFactory | None = None) -> None:
    """`nebula stage run`: this process's rank of stage `name`, until the job is done. `principal`: the
    job it runs for, as its entry point was told; `observe`: how rank 0 gets its watch (status, metrics)."""
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
    label = name if world == 1 else f"{name}/{rank}"
    watch = observe(label, config.address, Path(workdir)) if observe is not None and rank == 0 else None
    stage = build_stage(job, name, workdir, quiet, rank, world, local_rank, site, principal=principal, watch=watch)
    ranks = None
    if world > 1:
        ranks = RankGroup.join(job, name, stage, rank, world)
        if rank != 0:
            ranks.serve()
            return
    try:
        # Only the stages it works with may write to it: a stranger's message, or silence, never fails it.
        peers = {job.stage(peer).address for peer in job.graph.peers(name)}
        with open_channel(site, config.address, peers=peers) as opened, \
                stage.context.metrics.watching(opened) as channel:
            runner = make_runner(job, name, stage, channel, ranks)
            try:
                runner.run()
            finally:
                runner.close()
    finally:
        if ranks is not None:
            ranks.close()
