"""Build a stage from the job file and run it on a channel it is handed.

What a stage may use of the world outside its maths comes in from its entry point (a site's
`nebula stage run`, nebula.site.stage_service; a one-site run; a test) and goes to the stage in its
StageContext: the data it may read (`DataAccess`, its site's grants for its job's principal) and what
watches it (a `Watch`, for its status and metrics); its channel goes to the runner.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nebula.errors import ConfigError, DataError
from nebula.runtime.job import JobConfig
from nebula.runtime.metrics import MetricsLog, Watch
from nebula.runtime.ranks import RankGroup
from nebula.runtime.registry import resolve_stage
from nebula.runtime.runner import StageRunner
from nebula.runtime.stage import Stage, StageContext
from nebula.runtime.warm_start import load_init
from nebula.security.grants import DataAccess
from nebula.transport.base import Channel


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
                local_rank: int = 0, *, access: DataAccess | None = None, watch: Watch | None = None) -> Stage:
    """The stage module, seeded from [train].seed and its position in the job (ranks alike). It reads
    [job].data through `access` (its site's grants for its job's principal; default: a plain directory,
    as in tests and one-site runs); `watch` follows rank 0's records."""
    config = job.stage(name)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device, local_rank)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    instance = job.replicas.instance(job.replica, name) if job.replicas is not None else name  # whole-r1
    label = instance if world == 1 else f"{instance}/{rank}"
    metrics = MetricsLog(workdir / "metrics.jsonl" if rank == 0 else None, label, job.train.log_every, quiet=quiet,
                         tensorboard=job.train.tensorboard, watch=watch)
    torch.manual_seed(job.train.seed + list(job.stages).index(name))
    context = StageContext(name=name, address=config.address, job=job, workdir=workdir, device=device,
                           metrics=metrics, rank=rank, world_size=world, access=access or DataAccess())
    try:
        stage = resolve_stage(config.impl)(context, config.options)
    except PermissionError as exc:
        # Unreadable data (a mount the stage's uid may not read): a traceback and a restart in a loop before;
        # retrying changes nothing, so a DataError, which a supervisor does not restart (exit 3).
        raise DataError(f"stage {name} cannot read {exc.filename}: permission denied to uid {os.getuid()}; make "
                        f"[job].data ({job.data}) readable by the user the stage runs as") from exc
    if config.init_from is not None:  # a warm start; a resume from the stage's own checkpoint overwrites it (said
        # once: a resumed stage would print it at every start, before saying which checkpoint it resumed)
        fresh = not any((workdir / "checkpoints").glob("step-*.pt"))
        loaded = load_init(stage, Path(config.init_from))
        metrics.event("init_from", file=config.init_from, **loaded, echo=fresh and rank == 0)
    return stage


def make_runner(job: JobConfig, name: str, stage: Stage, channel: Channel, ranks: RankGroup | None = None,
                timeout: float = 300.0) -> StageRunner:
    return StageRunner(job, name, stage, channel, stage.context.workdir, stage.context.metrics, ranks=ranks,
                       timeout=timeout)
