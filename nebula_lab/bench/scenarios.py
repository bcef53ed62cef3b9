"""Benchmark scenarios: what a workload tells `nebula bench wan` about its job.

A workload's spec (nebula.workload) names its scenario, `scenario = "package.module:OBJECT"`, and the
workload's name is the scenario's (`--scenario NAME`); the benchmark itself knows nothing of the
workload: its job, its metric and how to score a run all come from the scenario. A scenario is one of:
- a `Scenario`: the lab runs Table 5 (speed and quality per compression setting) on its job;
- an `OwnBenchmark`: tables of its own (e.g. throughput), which `nebula bench wan` runs, lending it the
  lab's tools (`LabTools`: the workload imports nothing of the lab), with options of its own;
- a `TimeToLoss`: the lab trains each of its settings until the validation loss reaches a target and
  times its steps on the emulated WAN (`--time-to-loss TARGET`, nebula_lab.bench.wan_ttl);
- a `PeerOnly`: no table of its own, only the hooks by which the replicas bench trains its whole-model job
  with DDP (`--scenario replicas --workload NAME`).
Every hook the lab calls is declared below (tests/unit/test_workload_spec.py holds the lab to it), and a
scenario that lacks one is refused when it loads, naming what is missing.
"""
from __future__ import annotations

import argparse
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from nebula import workload
from nebula.errors import ConfigError


@dataclass(frozen=True)
class LabTools:
    """What the lab lends a scenario's own benchmark (`bench(args, lab)`)."""

    bound_factor: float  # the default uncompressed wire / compute of the communication-bound regime
    workdir: Callable[[Path | None], AbstractContextManager[Path]]  # a kept --workdir, or a temporary one
    run_job: Callable[..., None]  # run_job(run, raw_job, label, wan=None): every site's services, to the end
    emulated_wan: Callable[..., Any]  # emulated_wan(name_prefix=, rate_mbit=, sites=, rtt_ms=0): a WanLink, a context


class Scenario(Protocol):
    """Table 5 of a workload: its job adapted for speed and for quality runs, and its quality metric."""

    job: Path  # the job file a scenario runs by default
    quality_key: str  # the metric's name, higher is better: the row key of the first split's score, and
    #                   of each split's as `{quality_key}_{split}`

    def speed_job(self, raw: dict, work: Path, steps: int) -> dict:
        """The raw job table adapted for a speed run of `steps` steps: fixed-shape data, no evaluation."""

    def quality_job(self, raw: dict, quick: bool, splits: tuple[str, ...] = ("test",),
                    sentences: int | None = None) -> dict:
        """The raw job table adapted for a quality run: score `splits` on `sentences` each (fewer with
        `quick`)."""

    def quality(self, run: Path, raw: dict) -> dict[str, Any]:
        """Row fields that score a finished quality run in `run`: `quality_key`, `{quality_key}_{split}`."""

    def sentence_stats(self, run: Path, raw: dict, split: str) -> Any:
        """The metric's sufficient statistics per scored sentence of `split`, an integer array (sentences, k):
        what the seeds' paired bootstrap resamples (nebula_lab.bench.seeds)."""

    def score_stats(self, sums: Any) -> float:
        """The metric from column sums of sentence_stats (a corpus-level score is no mean of sentences')."""

    def step_bytes(self, raw: dict) -> int:
        """Uncompressed bytes one step sends on the link the benchmark compresses."""


class OwnBenchmark(Protocol):
    """A workload whose tables are not Table 5's: it runs them itself, with the lab's tools."""

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """Its own options, in an argument group of their own (refused with another scenario)."""

    def bench(self, args: argparse.Namespace, lab: LabTools) -> int:
        """Runs its benchmark; the exit code."""


class TimeToLoss(Protocol):
    """A workload judged by T = steps to a target validation loss x steady step time (`--time-to-loss`)."""

    job: Path  # the job file a scenario runs by default

    def ttl_job(self, raw: dict, quick: bool) -> dict:
        """The raw job table adapted for time-to-loss runs (the model's size, its evaluation)."""

    def ttl_settings(self, quick: bool) -> list[dict]:
        """The settings to compare, the first the dense reference: each {"name", "forward", "backward"
        (codec specs for every link), "schedule" (a name, or None: the job's), "stages" (options set on
        every stage, e.g. an architecture's; {} for none), and optionally "seeds": k (train only the first k
        of --seeds: an ablation)}. A setting with "auto" codecs is not trained: its steps are those of the
        setting trained with the rung it chose on the link (nebula_lab.bench.wan_ttl)."""

    def speed_job(self, raw: dict, work: Path, steps: int) -> dict:
        """The raw job table adapted for a speed run of `steps` steps: no evaluation."""

    def eval_curve(self, run: Path, raw: dict) -> list[list[float]]:
        """[step, validation loss] of every evaluation a run in `run` made so far, in step order."""

    def step_bytes(self, raw: dict) -> int:
        """Uncompressed bytes one step sends on a link (the largest)."""


class TorchPeer(Protocol):
    """A workload whose stage chain also runs under torch.distributed.pipelining, the peer of `--peer torch`
    (nebula_lab.bench.torch_peer): each rank builds its stage as Nebula does, then calls these."""

    def peer_module(self, stage: Any, first: bool, last: bool, dtype: Any) -> Any:
        """The stage's module as torch's pipeline calls it (one tensor in, one out; `dtype` on the wire)."""

    def peer_batch(self, stage: Any, indices: list[int]) -> tuple[Any, Any]:
        """(inputs of the first stage, targets of the last) for the training examples at `indices`."""

    def peer_loss(self, output: Any, target: Any) -> Any:
        """The last stage's loss of one micro-batch."""


AnyScenario = Scenario | OwnBenchmark | TimeToLoss


class DdpPeer(TorchPeer, Protocol):
    """A workload whose whole-model job the replicas bench (`--scenario replicas --peer ddp`) also trains
    with PyTorch DDP (nebula_lab.bench.ddp_peer): the whole model as one module (`peer_module(stage, True,
    True, float32)`: inputs in, the loss's input out), and its validation loss as the runtime scores it."""

    def peer_eval(self, stage: Any, module: Any) -> float:
        """The validation loss of `module` (the stage's whole model) on the windows the runtime's evaluation
        scores."""


class PeerOnly(DdpPeer, Protocol):
    """A workload with no table of its own whose whole-model job the replicas bench runs (`--workload NAME`,
    its deploy/jobs/NAME-replicas.toml) against DDP: the peer's hooks alone (`nebula bench wan --scenario
    NAME` says to use it so)."""

    peer_only: bool


def hooks(protocol: type) -> list[str]:
    """The attributes and methods a protocol declares: what the lab may use of a scenario."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return sorted({*protocol.__annotations__, *methods})


KINDS = (OwnBenchmark, TimeToLoss, Scenario, PeerOnly)  # the order a scenario is recognised in


def is_own(scenario: AnyScenario) -> bool:
    return all(hasattr(scenario, name) for name in hooks(OwnBenchmark))


def kind_of(scenario: AnyScenario) -> type:
    """The first protocol of KINDS whose every hook `scenario` has (Scenario, the default, if none)."""
    return next((kind for kind in KINDS if all(hasattr(scenario, name) for name in hooks(kind))), Scenario)


def scenario_refs() -> dict[str, str]:
    """Workload name -> its scenario's reference, for every installed spec that names one."""
    return {name: spec.scenario for name, spec in sorted(workload.installed().loaded.items()) if spec.scenario}


def scenario_names() -> list[str]:
    return list(scenario_refs())


def chosen_name(name: str | None) -> str:
    """`name`, or the only scenario installed."""
    refs = scenario_refs()
    if name is None:
        if len(refs) != 1:
            raise ConfigError(f"choose a benchmark scenario with --scenario: installed {', '.join(refs) or 'none'}")
        return next(iter(refs))
    if name not in refs:
        raise ConfigError(f"unknown benchmark scenario {name!r}; installed: {', '.join(refs) or 'none'}"
                          f"{workload.installed().note()}")
    return name


def load_scenario(name: str | None) -> AnyScenario:
    """The scenario called `name`, or the only one installed, checked for every hook of its kind."""
    name = chosen_name(name)
    ref = scenario_refs()[name]
    scenario = workload.load(ref, f"the bench scenario of {name}")
    if kind_of(scenario) is Scenario:
        missing = [hook for hook in hooks(Scenario) if not hasattr(scenario, hook)]
        if missing:
            raise ConfigError(f"the bench scenario of {name} ({ref}) lacks {', '.join(missing)}: a scenario "
                              "implements nebula_lab.bench.scenarios.Scenario (Table 5), OwnBenchmark or TimeToLoss")
    return scenario
