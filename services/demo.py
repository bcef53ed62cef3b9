"""`nebula demo [WORKLOAD]`: a workload end to end on this machine (ABNet-Cloud when none is named).

Each workload registers its demo under the entry-point group `nebula.demos` as a `Demo`: a summary,
the options of its own and the function that runs it. `--job`, `--steps` and `--run-dir` are
shared; an option of one workload given to another is an error, not silently ignored.

A demo checks every argument before it writes anything, and deletes nothing it did not write: its
run directory is a new or empty one, or one an earlier demo made (marked by MARK), which it empties.
"""
from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import tomllib

from nebula.errors import ConfigError
from nebula.shipped import data_dir, job_file

ENTRY_POINT_GROUP = "nebula.demos"
DEFAULT = "abnet"  # what `nebula demo` has always run (README)
MARK = ".nebula-demo"  # written into every run directory a demo makes: only such a directory is emptied


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
    parser.add_argument("--job", type=Path, default=None,
                        help="job file, or the name of a shipped job such as abnet-zh-en (default: the workload's)")
    parser.add_argument("--steps", type=int, default=None, help="override the job's [train].steps")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="logs, keys, checkpoints, plot: a new or empty directory, or an earlier demo's, which "
                             "is emptied first (default: runs/demo, runs/demo-WORKLOAD for the others)")
    owners = {}  # option dest -> (workload, action): to refuse an option meant for another workload
    for name, demo in sorted(demos.items()):
        for action in demo.add_arguments(parser.add_argument_group(f"{name} options")):
            owners[action.dest] = (name, action)
    parser.set_defaults(func=lambda args: dispatch(args, demos, owners))


def dispatch(args: argparse.Namespace, demos: dict[str, Demo], owners: dict) -> int:
    for dest, (owner, action) in owners.items():
        if owner != args.workload and getattr(args, dest) != action.default:
            raise ConfigError(f"{action.option_strings[0]} is an option of `nebula demo {owner}`, "
                              f"not of `nebula demo {args.workload}`")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be a positive integer")
    if args.job is not None:
        args.job = job_file(args.job)
    if args.run_dir is None:
        args.run_dir = Path("runs/demo" if args.workload == DEFAULT else f"runs/demo-{args.workload}")
    return demos[args.workload].run(args)


# -- the run directory ----------------------------------------------------------------------------------
def check_run_dir(run: Path) -> None:
    """Refuse a run directory the demo may not write: a file, or one holding files it did not write."""
    if run.exists() and not run.is_dir():
        raise ConfigError(f"--run-dir {run} is a file, not a directory: pass another --run-dir")
    if run.is_dir() and any(run.iterdir()) and not (run / MARK).is_file():
        raise ConfigError(f"--run-dir {run} already holds files that `nebula demo` did not write: the demo does "
                          f"not delete them; pass another --run-dir (a new or empty directory, or an earlier "
                          f"demo's), or remove {run} yourself")


def fresh_run_dir(run: Path) -> None:
    """Make `run` an empty run directory carrying MARK: a new one, an empty one, or an earlier demo's,
    emptied. Refused (check_run_dir) before anything is deleted. Call it after every other check."""
    check_run_dir(run)
    if run.is_dir():
        for entry in run.iterdir():  # the demo's own files: the directory has MARK or nothing
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    run.mkdir(parents=True, exist_ok=True)
    (run / MARK).write_text("written by `nebula demo`: a demo run here again empties this directory first\n")


def check_apart(run: Path, source: Path, option: str) -> None:
    """`source` (read by the demo) must not lie inside `run`, which the demo empties."""
    if source.resolve().is_relative_to(run.resolve()):
        raise ConfigError(f"{option} {source} lies inside --run-dir {run}, which the demo empties first: "
                          "pass a --run-dir elsewhere")


# -- job files --------------------------------------------------------------------------------------------
def job_copy(source: Path, steps: int | None = None) -> dict[str, Any]:
    """Job file `source` as a dict, [job].data made absolute (nebula.shipped.data_dir: a shipped job's data
    is ./data when installed) and [train].steps replaced by `steps` if given. The demo writes it into its
    run directory (write_job), so that every process it starts reads one job, wherever the file came from."""
    # why here: torch, pynacl, kept off `nebula --help`
    from nebula.runtime.job import load_job
    from nebula.security.grants import PREFIX
    load_job(source)  # a missing, unreadable or invalid file is refused here, naming what to fix
    raw = tomllib.loads(source.read_text())
    data = raw["job"].get("data")
    if data and not data.startswith(PREFIX):  # a directory, not a data set read through a grant
        raw["job"]["data"] = str(data_dir(source, data))
    if steps is not None:
        raw.setdefault("train", {})["steps"] = steps
    return raw


def write_job(raw: dict[str, Any], out: Path, source: Path) -> Path:
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import write_job_file
    write_job_file(out, raw, note=f"written by `nebula demo` from {source}")
    return out
