"""The job's [replicas] table: the same stage graph at R sites or site groups, synchronised every H steps.

    [replicas]
    groups = [["a"], ["b"], ["c"]]   # one list of sites per replica; the first is the job's own sites
    # count = 3                      # or only a count: every replica at the job's sites (names -r1, -r2)
    H = 50                           # inner steps per outer round
    codec = "int8"                   # the pseudo-gradient's codec (nebula/codecs spec strings)
    exchange = "all-to-all"          # or "sharded": each replica averages 1/R of the vector (reduce-scatter)
    fragments = 1                    # streaming: the parameters in F fragments, synchronised staggered
    overlap = 0                      # inner steps a fragment's exchange runs under before it is merged
    deadline_s = 60                  # how long a round waits for the other replicas' pseudo-gradients
    [replicas.outer]
    lr = 0.7                         # Nesterov SGD on the averaged pseudo-gradient (DiLoCo's defaults)
    momentum = 0.9

Replica k runs every stage of the job at its group's sites: site i of the job (in the order the job's
stages name them) is site i of group k. Its stages' addresses are the job's with the sites mapped; where
two replicas would share an address (a count without groups, or groups that share a site) the later
replica's stage is named `<stage>-r<k>` in it. Each (replica, stage) is an *instance*, run as its own
service under its instance name: the stage's name in replica 0, `<stage>-r<k>` in replica k.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from nebula.codecs.spec import parse
from nebula.config import build, limits
from nebula.errors import ConfigError
from nebula.security.certs import check_site_name, reserved_name_error

MAX_REPLICAS = 64


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer optimiser, applied to the average of the replicas' pseudo-gradients."""

    name: Literal["nesterov", "sgd"] = "nesterov"  # SGD with Nesterov momentum (DiLoCo), or heavy-ball
    lr: float = field(default=0.7, metadata=limits(above=0, at_most=10))
    momentum: float = field(default=0.9, metadata=limits(at_least=0, below=1))


@dataclass(frozen=True, kw_only=True)
class ReplicasConfig:
    count: int | None = field(default=None, metadata=limits(at_least=2, at_most=MAX_REPLICAS,
                                                            hint="one replica is the job itself: remove [replicas]"))
    groups: tuple[tuple[str, ...], ...] = ()
    H: int = field(default=50, metadata=limits(at_least=1, hint="inner steps per outer round"))
    codec: str = "none"
    # "all-to-all": each replica sends its pseudo-gradient to every other, R - 1 vectors a round;
    # "sharded": to the replica that averages that 1/R of it, which sends the mean back: 2 (R - 1) / R
    exchange: Literal["all-to-all", "sharded"] = "all-to-all"
    fragments: int = field(default=1, metadata=limits(at_least=1))
    overlap: int = field(default=0, metadata=limits(at_least=0))
    deadline_s: float = field(default=60.0, metadata=limits(above=0))
    start_timeout_s: float = field(default=600.0, metadata=limits(above=0))  # waiting for the others at start
    outer: OuterConfig = field(default_factory=OuterConfig)

    @property
    def replicas(self) -> int:
        return len(self.groups) if self.groups else self.count or 1

    def sync_offset(self, fragment: int) -> int:
        """Fragment f is sent at the steps t with t % H == its offset (staggered: f x H / F)."""
        return fragment * self.H // self.fragments


@dataclass(frozen=True)
class ReplicaSet:
    """The [replicas] table, resolved against the job's stages: every replica's addresses."""

    config: ReplicasConfig
    addresses: tuple[dict[str, str], ...]  # replica k -> stage name -> its address there

    @property
    def count(self) -> int:
        return len(self.addresses)

    def instance(self, k: int, stage: str) -> str:
        """The service name of `stage` in replica k."""
        return stage if k == 0 else f"{stage}-r{k}"

    def instances(self) -> dict[str, tuple[int, str]]:
        """Every instance name -> (replica, stage)."""
        return {self.instance(k, s): (k, s) for k, table in enumerate(self.addresses) for s in table}

    def peers(self, k: int, stage: str) -> dict[int, str]:
        """The other replicas' instances of `stage`: replica -> address."""
        return {j: table[stage] for j, table in enumerate(self.addresses) if j != k}


def build_replicas(table: Any, stages: Mapping[str, Any], schedule: Any, where: str) -> ReplicaSet:
    """The [replicas] table checked against the job (`stages`: name -> StageConfig; `schedule`: the job's)."""
    at = f"{where}: [replicas]"
    config = build(ReplicasConfig, table, at)
    sites = list(dict.fromkeys(s.site for s in stages.values()))
    groups = _groups(config, sites, at)
    if not 2 <= len(groups) <= MAX_REPLICAS:
        raise ConfigError(f"{at}.groups: {len(groups)} replicas; give 2 to {MAX_REPLICAS} lists of sites (one "
                          "replica is the job itself: remove [replicas])")
    _check_rounds(config, at)
    _check_codec(config.codec, f"{at}.codec")
    if not schedule.exact_weights:
        raise ConfigError(f"{at}: schedule {schedule.name!r} runs a step's forward before the previous update, "
                          "across which an outer round would change the weights; use \"synchronous\", "
                          "\"gpipe\" or \"1f1b\" with replicas")
    addresses: list[dict[str, str]] = []
    taken: set[str] = set()
    for k, group in enumerate(groups):
        mapped = dict(zip(sites, group))
        table = {}
        for name, stage in stages.items():
            _, part, rank = stage.address.split("/")
            address = f"{mapped[stage.site]}/{part}/{rank}"
            if address in taken:  # another replica runs this stage at this site: a name of its own
                address = f"{mapped[stage.site]}/{part}-r{k}/{rank}"
            if (why := reserved_name_error(address, "stage")) or address in taken:
                raise ConfigError(f"{at}: replica {k}'s stage {name} would be {address}: "
                                  f"{why or 'already taken'}; rename the stage")
            taken.add(address)
            table[name] = address
        addresses.append(table)
    found = ReplicaSet(config, tuple(addresses))
    for name, (k, stage) in found.instances().items():
        if k and name in stages:
            raise ConfigError(f"{at}: replica {k}'s instance of stage {stage} is named {name}, which is a stage "
                              "of the job too; rename that stage")
    return found


def _groups(config: ReplicasConfig, sites: list[str], at: str) -> list[tuple[str, ...]]:
    """The site group of every replica: given, or the job's own sites `count` times."""
    if not config.groups:
        if config.count is None:
            raise ConfigError(f"{at}: say how many replicas: count = R (all at the job's sites), or groups = "
                              f"[{sites!r}, [...]] (one list of sites per replica)")
        return [tuple(sites)] * config.count
    if config.count is not None and config.count != len(config.groups):
        raise ConfigError(f"{at}: count = {config.count} but groups lists {len(config.groups)} replicas; "
                          "give one of them")
    if list(config.groups[0]) != sites:
        raise ConfigError(f"{at}.groups[0]: {list(config.groups[0])} must be the job's own sites {sites}, in the "
                          "order its stages name them (replica 0 is the job as written)")
    for k, group in enumerate(config.groups):
        if len(group) != len(sites) or len(set(group)) != len(group):
            raise ConfigError(f"{at}.groups[{k}]: {list(group)} must name {len(sites)} different sites, one for "
                              f"each of the job's sites {sites} (site i of the job runs at site i of the group)")
        for site in group:
            try:
                check_site_name(site)
            except ConfigError as exc:
                raise ConfigError(f"{at}.groups[{k}]: {exc}") from None
    return [tuple(g) for g in config.groups]


def _check_rounds(config: ReplicasConfig, at: str) -> None:
    if config.H % config.fragments:
        raise ConfigError(f"{at}: H = {config.H} must be a multiple of fragments = {config.fragments} (fragment f "
                          "is synchronised at steps f x H / fragments + k x H)")
    if config.overlap >= config.H // config.fragments:
        raise ConfigError(f"{at}: overlap = {config.overlap} must be below H / fragments = "
                          f"{config.H // config.fragments}: a fragment's exchange is merged before its next one")


def _check_codec(spec: str, at: str) -> None:
    try:
        codec = parse(spec)
    except ConfigError as exc:
        raise ConfigError(f"{at}: {exc}") from exc
    if codec.needs_ids:
        raise ConfigError(f"{at}: {spec!r} keeps rows per example (activations only); a pseudo-gradient is a "
                          "weight: use e.g. \"int8\", \"int4\" or \"ef(topk(0.01))\"")
