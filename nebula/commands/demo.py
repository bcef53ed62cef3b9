"""`nebula demo [WORKLOAD]`: a workload end to end on this machine (the default demo when none is named).

A workload's spec (nebula.workload) names its demo, a `Demo`: a summary, the job it runs, the options of
its own and the function that runs it. `--job`, `--steps` and `--run-dir` are shared; an option of one
workload given to another is an error, not silently ignored. The demo of the workload whose `Demo` says
`default=True` runs when none is named (or the only one installed).

A demo checks every argument before it writes anything, and deletes nothing it did not write: its
run directory is a new or empty one, or one an earlier demo made (marked by MARK), which it empties.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from nebula import workload
from nebula.errors import ConfigError
from nebula.shipped import data_dir, job_file

MARK = ".nebula-demo"  # written into every run directory a demo makes: only such a directory is emptied


@dataclass(frozen=True)
class Demo:
    summary: str
    run: Callable[[argparse.Namespace], int]
    job: Path  # the job file it runs unless --job is given
    # adds the workload's own options to its argument group; returns the actions it added
    add_arguments: Callable[[argparse._ArgumentGroup], list[argparse.Action]] = lambda group: []
    default: bool = False  # what `nebula demo` runs with no workload named (at most one installed demo says so)


def installed() -> dict[str, Demo]:
    """Workload name -> its demo. Imported when the parser is built: a demo module keeps its heavy imports
    inside `run`. A demo that cannot be imported is left out, with a warning: the others still run."""
    demos = {}
    for name, spec in workload.installed().loaded.items():
        if spec.demo is not None:
            try:
                demos[name] = workload.load(spec.demo, f"the demo of {name}")
            except ConfigError as exc:
                print(f"nebula: warning: {exc}", file=sys.stderr)
    return demos


def default_demo(demos: dict[str, Demo]) -> str | None:
    """The name of the demo `nebula demo` runs: the one marked default, else the only one installed; None
    when that is not one demo (then `nebula demo` asks for a name)."""
    marked = [name for name, demo in demos.items() if demo.default] or list(demos)
    return marked[0] if len(marked) == 1 else None


def default_job() -> Path:
    """The job `nebula demo` runs with no arguments: a tool's default real job (e.g. `nebula bench chaos`)."""
    demos = installed()
    name = default_demo(demos)
    if name is None:
        raise ConfigError(f"no default demo among the installed ({', '.join(demos) or 'none'}), so no default job: "
                          "give --job")
    return demos[name].job


def register(sub) -> None:
    demos = installed()
    first = default_demo(demos)
    parser = sub.add_parser("demo", help=f"a workload across local sites, end to end (default: {first})",
                            description="; ".join(f"{name}: {demo.summary} (job {demo.job.stem})"
                                                  for name, demo in sorted(demos.items())))
    parser.add_argument("workload", nargs="?" if first else None, default=first, choices=sorted(demos),
                        help=f"which demo (default: {first})" if first else "which demo")
    parser.add_argument("--job", type=Path, default=None,
                        help="job file, or the name of a shipped job (deploy/jobs; default: the workload's)")
    parser.add_argument("--steps", type=int, default=None, help="override the job's [train].steps")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="logs, keys, checkpoints, plot: a new or empty directory, or an earlier demo's, which "
                             f"is emptied first (default: runs/demo{f' for {first}' if first else ''}, "
                             "runs/demo-WORKLOAD for the others)")
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
        args.run_dir = Path("runs/demo" if args.workload == default_demo(demos) else f"runs/demo-{args.workload}")
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
