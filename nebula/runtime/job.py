"""A job file (TOML) parsed once into typed, validated dataclasses."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nebula.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    address: str  # site/stage/rank, e.g. "a/encoder/0"
    impl: str  # registered stage name or "package.module:Class"
    options: dict[str, Any] = field(default_factory=dict)  # implementation-specific (model, adapter size...)

    @property
    def site(self) -> str:
        return self.address.split("/")[0]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 32
    micro_batches: int = 4
    # 0: each step's forward uses the weights of the previous step (exact; every step pays the pipeline
    # fill and drain). 1: the head starts step t+1's forward before applying step t's gradients
    # (PipeDream-2BW): its gradients are computed at weights one update old, and there is no per-step bubble.
    staleness: int = 0
    max_len: int = 32
    lr: float = 5e-4
    warmup_steps: int = 50
    seed: int = 1
    checkpoint_every: int = 25
    log_every: int = 10


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str
    data: str  # directory holding {train,valid,test}.{src,tgt,ids}
    stages: dict[str, StageConfig]
    train: TrainConfig = TrainConfig()
    compression: dict[str, Any] = field(default_factory=dict)  # CompressionPolicy.from_dict input
    source: Path | None = None

    def stage(self, name: str) -> StageConfig:
        if name not in self.stages:
            raise ConfigError(f"job {self.name}: no [stages.{name}] section (have: {', '.join(self.stages)})")
        return self.stages[name]


def _build(cls, table: dict[str, Any], where: str):
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(known))}")
    try:
        return cls(**table)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _check_train(train: TrainConfig, where: str) -> None:
    for name in ("steps", "batch_size", "micro_batches", "max_len", "checkpoint_every", "log_every"):
        value = getattr(train, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}.{name}: must be a positive integer, got {value!r}")
    if train.batch_size % train.micro_batches:
        raise ConfigError(f"{where}: batch_size {train.batch_size} must be a multiple of "
                          f"micro_batches {train.micro_batches}")
    if train.staleness not in (0, 1):
        raise ConfigError(f"{where}.staleness: must be 0 (synchronous) or 1 (one-step-stale head weights), "
                          f"got {train.staleness!r}")
    if not 0 < train.lr < 1:
        raise ConfigError(f"{where}.lr: must be in (0, 1), got {train.lr!r}")


def _check_address(address: Any, where: str) -> None:
    parts = address.split("/") if isinstance(address, str) else []
    if len(parts) != 3 or not all(parts) or not parts[2].isdigit():
        raise ConfigError(f"{where}.address: {address!r} is not site/stage/rank, e.g. 'a/encoder/0'")


def parse_job(raw: dict[str, Any], source: Path | None = None) -> JobConfig:
    where = str(source or "job")
    job = dict(raw.get("job", {}))
    for key in ("name", "data"):
        if not isinstance(job.get(key), str) or not job[key]:
            raise ConfigError(f"{where}: [job].{key} is required (a string)")
    stages = {}
    for name, table in raw.get("stages", {}).items():
        table = dict(table)
        options = {k: table.pop(k) for k in list(table) if k not in ("address", "impl")}
        stage = _build(StageConfig, {**table, "options": options}, f"{where}: [stages.{name}]")
        _check_address(stage.address, f"{where}: [stages.{name}]")
        stages[name] = stage
    if not stages:
        raise ConfigError(f"{where}: at least one [stages.NAME] section is required")
    train = _build(TrainConfig, raw.get("train", {}), f"{where}: [train]")
    _check_train(train, f"{where}: [train]")
    unknown = set(raw) - {"job", "stages", "train", "compression"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    data = Path(job["data"])
    if source and not data.is_absolute():
        data = (source.parent / data).resolve()  # relative paths are relative to the job file
    compression = dict(raw.get("compression", {}))
    from nebula.runtime.link import parse_phases  # imports the codecs (and torch): only when a job loads
    parse_phases(compression)  # an unknown codec or bad value fails here, before any stage starts
    return JobConfig(name=job["name"], data=str(data), stages=stages, train=train, compression=compression,
                     source=source)


def load_job(path: str | Path) -> JobConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"job file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job file {path} is not valid TOML: {exc}") from exc
    return parse_job(raw, source=path)
