"""`nebula demo [WORKLOAD]`: a workload end to end on this machine (ABNet-Cloud when none is named).

Each workload registers its demo under the entry-point group `nebula.demos` as a `Demo`: a summary,
the options of its own and the function that runs it. `--job`, `--steps` and `--run-dir` are
shared; an option of one workload given to another is an error, not silently ignored.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

ENTRY_POINT_GROUP = "nebula.demos"
DEFAULT = "abnet"  # what `nebula demo` has always run (README)


@dataclass(frozen=True)
class Demo:
    summary: str
    run: Callable[[argparse.Namespace], int]
    # adds the workload's own options to its argument group; returns the actions it added
    add_arguments: Callable[[argparse._ArgumentGroup], list[argparse.Action]] = lambda group: []


def installed() -> dict[str, Demo]:
    # imported when the parser is built: a demo module keeps its heavy imports inside `run`
    return {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}


def register(sub) -> None:
    demos = installed()
    parser = sub.add_parser("demo", help="a workload across local sites, end to end (default: abnet)",
                            description="; ".join(f"{name}: {demo.summary}" for name, demo in sorted(demos.items())))
    parser.add_argument("workload", nargs="?", default=DEFAULT, choices=sorted(demos),
                        help=f"which demo (default: {DEFAULT})")
    parser.add_argument("--job", type=Path, default=None, help="job file (default: the workload's)")
    parser.add_argument("--steps", type=int, default=None, help="override the job's [train].steps")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="logs, keys, checkpoints, plot (default: runs/demo, runs/demo-WORKLOAD for the others)")
    owners = {}  # option dest -> (workload, action): to refuse an option meant for another workload
    for name, demo in sorted(demos.items()):
        for action in demo.add_arguments(parser.add_argument_group(f"{name} options")):
            owners[action.dest] = (name, action)
    parser.set_defaults(func=lambda args: dispatch(args, demos, owners))


def dispatch(args: argparse.Namespace, demos: dict[str, Demo], owners: dict) -> int:
    from nebula.errors import ConfigError
    for dest, (owner, action) in owners.items():
        if owner != args.workload and getattr(args, dest) != action.default:
            raise ConfigError(f"{action.option_strings[0]} is an option of `nebula demo {owner}`, "
                              f"not of `nebula demo {args.workload}`")
    if args.run_dir is None:
        args.run_dir = Path("runs/demo" if args.workload == DEFAULT else f"runs/demo-{args.workload}")
    return demos[args.workload].run(args)
