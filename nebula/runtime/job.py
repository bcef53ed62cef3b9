"""A job file (TOML) parsed once into typed, checked dataclasses: the graph, the schedule, each
stage's options. Every mistake is a ConfigError naming the file and the key, before any model loads.

    [job]        name = "chain"   data = "../../data/chain"
    [train]      steps = 200   batch_size = 16   micro_batches = 4   seed = 1   checkpoint_every = 25
    [schedule]   name = "synchronous"          # "one-step-stale", "forward-only" (+ credit = k): runtime.schedules
    [stages.src]   address = "a/src/0"   impl = "example-source"   lr = 1e-2   # + its options
    [stages.sink]  address = "b/sink/0"  impl = "example-sink"     ranks = 2
    [[links]]    from = "src"   to = "sink"   tensors = ["hidden"]   backward = true
    [links.compression]   forward = "fp16"   backward = "int8"     # the link just above (or: compression = "auto")
    [replicas]   groups = [["a", "b"], ["c", "d"]]   H = 50   codec = "int8"    # nebula.runtime.replica_set

See docs/runtime.md for every key.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula.codecs.policy_table import read_policy
from nebula.config import build, check, limits, read_toml
from nebula.errors import ConfigError
from nebula.runtime.graph import Graph, LinkConfig, check_ports
from nebula.runtime.integrity import IntegrityConfig
from nebula.runtime.registry import resolve_stage
from nebula.runtime.replica_set import ReplicaSet, build_replicas
from nebula.runtime.schedules import Schedule, build_schedule
from nebula.runtime.stage import options_of
from nebula.runtime.train import TrainConfig
from nebula.security.certs import reserved_name_error

_STAGE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")

MOVED = {
    "staleness": 'the schedule is chosen by name now: [schedule] name = "one-step-stale" (staleness = 1) '
                 'or "synchronous" (staleness = 0)',
    **{key: f"{key} is an option of each stage now: set it under [stages.NAME]"
       for key in ("lr", "warmup_steps", "max_len")},
}


@dataclass(frozen=True, kw_only=True)
class JobSection:
    name: str
    data: str | None = None  # the job's data directory, relative to the job file, or "dataset:NAME" (a grant)


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """The framework's keys of a [stages.NAME] table; every other key is an option of the implementation."""

    address: str  # site/stage/0: rank 0 owns the stage's links
    impl: str  # a registered stage name or "package.module:Class"
    ranks: int = field(default=1, metadata=limits(at_least=1, at_most=1024))  # or "auto": nebula.runtime.autoranks
    max_ranks: int = field(default=4, metadata=limits(at_least=1, at_most=1024))  # what "auto" may choose
    auto_ranks: bool = False  # set by ranks = "auto": the launcher measures and fixes ranks before the start
    device: str = "auto"  # cpu | cuda | cuda:N | auto (cuda when available)
    threads: int | None = field(default=None, metadata=limits(at_least=1))  # torch intra-op threads
    init_from: str | None = None  # weights to start from (nebula.runtime.warm_start), relative to the job file
    options: Any = None  # the implementation's Options dataclass, checked

    @property
    def site(self) -> str:
        return self.address.split("/")[0]


@dataclass(frozen=True)
class JobConfig:
    name: str
    data: str | None
    train: TrainConfig
    schedule: Schedule
    stages: dict[str, StageConfig]
    links: tuple[LinkConfig, ...]
    source: Path | None = None
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)  # [integrity]: nebula.runtime.integrity
    replicas: ReplicaSet | None = None  # [replicas]: the graph replicated (cross-site data parallelism)
    replica: int = 0  # which replica `stages` addresses (replica_view)

    def stage(self, name: str) -> StageConfig:
        if name not in self.stages:
            raise ConfigError(f"job {self.name}: no [stages.{name}] section (have: {', '.join(self.stages)})")
        return self.stages[name]

    def replica_view(self, k: int) -> JobConfig:
        """The job as replica k runs it: its stages at its addresses, its own coordinator and graph."""
        if self.replicas is None or not 0 <= k < self.replicas.count:
            raise ConfigError(f"job {self.name} has no replica {k}")
        table = self.replicas.addresses[k]
        stages = {n: dataclasses.replace(s, address=table[n]) for n, s in self.stages.items()}
        return dataclasses.replace(self, stages=stages, replica=k)

    def instances(self) -> dict[str, StageConfig]:
        """Every service of the job: each stage of each replica, by its instance name (nebula.runtime.replica_set)."""
        if self.replicas is None:
            return dict(self.stages)
        return {name: dataclasses.replace(self.stages[stage], address=self.replicas.addresses[k][stage])
                for name, (k, stage) in self.replicas.instances().items()}

    def for_instance(self, name: str) -> tuple[JobConfig, str]:
        """(the job as the instance's replica runs it, the stage's name in it)."""
        if self.replicas is None:
            self.stage(name)
            return self, name
        found = self.replicas.instances().get(name)
        if found is None:
            raise ConfigError(f"job {self.name}: no stage or replica instance {name!r} (have: "
                              f"{', '.join(self.replicas.instances())})")
        return self.replica_view(found[0]), found[1]

    @functools.cached_property
    def graph(self) -> Graph:
        return Graph(list(self.stages), self.links, self.train.micro_batches, str(self.source or "job"))

    @property
    def sites(self) -> list[str]:
        """Every site the job runs at (every replica's)."""
        return list(dict.fromkeys(stage.site for stage in self.instances().values()))


def parse_job(raw: dict[str, Any], source: Path | None = None) -> JobConfig:
    where = str(source or "job")
    if "compression" in raw:
        raise ConfigError(f"{where}: [compression] is per link now: move it under the link it applies to, "
                          "as [links.compression] after that [[links]] entry (docs/codecs.md)")
    unknown = sorted(set(raw) - {"job", "train", "schedule", "stages", "links", "integrity", "replicas"})
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(unknown)}; allowed: job, train, schedule, "
                          "stages, links, integrity, replicas")
    job = build(JobSection, raw.get("job"), f"{where}: [job]")
    train = build(TrainConfig, raw.get("train", {}), f"{where}: [train]", renamed=MOVED)
    schedule = build_schedule(raw.get("schedule", {}), f"{where}: [schedule]")
    stages = check(dict[str, dict], raw.get("stages", {}), f"{where}: [stages]")
    if not stages:
        raise ConfigError(f"{where}: at least one [stages.NAME] section is required")
    classes, configs = {}, {}
    for name, table in stages.items():
        configs[name], classes[name] = _stage(name, table, f"{where}: [stages.{name}]")
        init = configs[name].init_from
        if init is not None and source is not None and not Path(init).is_absolute():  # as [job].data
            configs[name] = dataclasses.replace(configs[name], init_from=str((source.parent / init).resolve()))
    _check_addresses(configs, where)
    links = tuple(_link(i, table, where) for i, table in
                  enumerate(check(list[dict], raw.get("links", []), f"{where}: [[links]]")))
    data = job.data
    if data is not None and source is not None and not Path(data).is_absolute() and not data.startswith("dataset:"):
        data = str((source.parent / data).resolve())  # relative paths are relative to the job file
    integrity = build(IntegrityConfig, raw.get("integrity", {}), f"{where}: [integrity]")
    replicas = build_replicas(raw["replicas"], configs, schedule, where) if "replicas" in raw else None
    config = JobConfig(name=job.name, data=data, train=train, schedule=schedule, stages=configs, links=links,
                       source=source, integrity=integrity, replicas=replicas)
    check_ports(config.graph, classes, config)
    schedule.check(config.graph)
    return config


def load_job(path: str | Path) -> JobConfig:
    path = Path(path)
    return parse_job(read_toml(path, "job file"), source=path)


def _stage(name: str, table: dict, where: str) -> tuple[StageConfig, type]:
    if not _STAGE_NAME.match(name):
        raise ConfigError(f"{where}: stage names are 1-32 lowercase letters, digits or '-', starting with a letter")
    framework = {"address", "impl", "ranks", "max_ranks", "device", "threads", "init_from"}
    keys = {k: v for k, v in table.items() if k in framework}
    auto = keys.get("ranks") == "auto"
    if auto:
        keys["ranks"] = 1  # until the launcher resolves it (nebula.runtime.autoranks)
    config = build(StageConfig, keys, where)
    config = dataclasses.replace(config, auto_ranks=auto)
    _check_device(config.device, f"{where}.device")
    cls = resolve_stage(config.impl)
    options = build(options_of(cls), {k: v for k, v in table.items() if k not in framework}, where)
    return dataclasses.replace(config, options=options), cls


def _check_device(device: str, where: str) -> None:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{where}: {device!r} is not a device; use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\" "
                          "(cuda when available)")


def _check_addresses(configs: dict[str, StageConfig], where: str) -> None:
    seen: dict[str, str] = {}  # address -> stage name
    for name, stage in configs.items():
        parts = stage.address.split("/")
        if len(parts) != 3 or not all(parts) or parts[2] != "0":
            raise ConfigError(f"{where}: [stages.{name}].address: {stage.address!r} is not site/stage/0, e.g. "
                              f"'a/{name}/0' (rank 0 owns the stage's links; more ranks: ranks = N)")
        reserved = reserved_name_error(stage.address, "stage")
        if reserved:  # no certificate would be issued or admitted for it: say so before anything starts
            raise ConfigError(f"{where}: [stages.{name}].address: {reserved}")
        if stage.address in seen:
            raise ConfigError(f"{where}: stages {seen[stage.address]} and {name} share the address {stage.address}")
        seen[stage.address] = name


@dataclass(frozen=True, kw_only=True)
class _LinkTable:
    tensors: tuple[str, ...]
    backward: bool
    compression: dict[str, Any] | str = field(default_factory=dict)  # a table, or "auto"


def _link(i: int, table: dict, where: str) -> LinkConfig:
    at = f"{where}: [[links]] #{i + 1}"
    ends = {}
    for key in ("from", "to"):
        if not isinstance(table.get(key), str):
            raise ConfigError(f"{at}: `{key}` (a stage name) is required")
        ends[key] = table[key]
    at = f"{where}: [[links]] {ends['from']}->{ends['to']}"
    body = build(_LinkTable, {k: v for k, v in table.items() if k not in ends}, at)
    if len(set(body.tensors)) != len(body.tensors):
        raise ConfigError(f"{at}.tensors: a tensor is listed twice")
    if not body.backward and (named := _backward_codecs(body.compression)):
        raise ConfigError(f"{at}.compression: {named} names a backward codec, but the link has "
                          "backward = false: no gradients go back on it; remove it, or set backward = true")
    return LinkConfig(src=ends["from"], dst=ends["to"], tensors=body.tensors, backward=body.backward,
                      compression=read_policy(body.compression, f"{at}.compression"))


def _backward_codecs(compression: dict[str, Any] | str) -> str | None:
    """Where a link's compression table names a backward codec (a key `backward`), or None."""
    if not isinstance(compression, dict):
        return None  # "auto": both directions, of which a forward-only link has one
    tables = [("", compression)] + [(f"phases[{i}].", p) for i, p in enumerate(compression.get("phases", []))
                                    if isinstance(p, dict)]
    for prefix, table in tables:
        if "backward" in table:
            return f"{prefix}backward"
        for name, override in (table.get("overrides") or {}).items():
            if isinstance(override, dict) and "backward" in override:
                return f"{prefix}overrides.{name}.backward"
    return None
