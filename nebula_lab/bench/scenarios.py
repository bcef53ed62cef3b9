"""Benchmark scenarios: what a workload tells `nebula bench wan` about its job.

A workload registers an object under the entry-point group `nebula.scenarios`
(`NAME = "package.module:OBJECT"`); the benchmark itself knows nothing of the workload. A scenario
whose tables are not Table 5's may instead provide `bench(args, lab) -> int`, which `nebula bench wan`
then runs, lending it the lab's tools (`LabTools`: the workload imports nothing of the lab), and
`add_arguments(group)` for options of its own (e.g. services/electra/bench.py).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Protocol

from nebula.errors import ConfigError

ENTRY_POINT_GROUP = "nebula.scenarios"


@dataclass(frozen=True)
class LabTools:
    """What the lab lends a scenario's own benchmark (`bench(args, lab)`)."""

    bound_factor: float  # the default uncompressed wire / compute of the communication-bound regime
    workdir: Callable[[Path | None], AbstractContextManager[Path]]  # a kept --workdir, or a temporary one
    run_job: Callable[..., None]  # run_job(run, raw_job, label, wan=None): every site's services, to the end
    emulated_wan: Callable[..., Any]  # emulated_wan(name_prefix=, rate_mbit=, sites=): a WanLink, a context


class Scenario(Protocol):
    job: Path  # the job file a scenario runs by default
    quality_key: str  # the row key of the quality metric ; higher is better

    def speed_job(self, raw: dict, work: Path, steps: int) -> dict:
        """The raw job table adapted for a speed run of `steps` steps: fixed-shape data, no evaluation."""

    def quality_job(self, raw: dict, quick: bool) -> dict:
        """The raw job table adapted for a quality run (e.g. a smaller evaluation with `quick`)."""

    def quality(self, run: Path, raw: dict) -> dict[str, Any]:
        """Row fields that score a finished quality run in `run` (at least `quality_key`)."""

    def step_bytes(self, raw: dict) -> int:
        """Uncompressed bytes one step sends on the link the benchmark compresses."""

    # optional: a scenario with tables of its own instead of Table 5's (e.g. electra: Tables 3 and 4)
    # def add_arguments(self, group: argparse._ArgumentGroup) -> None: its own options, in a group of their own
    # def bench(self, args: argparse.Namespace, lab: LabTools) -> int: runs its benchmark, the exit code


def scenario_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_scenario(name: str | None) -> Scenario:
    """The scenario called `name`, or the only one installed."""
    if name is None:
        names = scenario_names()
        if len(names) != 1:
            raise ConfigError(f"choose a benchmark scenario with --scenario: installed {', '.join(names) or 'none'}")
        name = names[0]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise ConfigError(f"unknown benchmark scenario {name!r}; installed: {', '.join(scenario_names()) or 'none'}")
