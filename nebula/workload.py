"""A workload's spec: everything it plugs into Nebula, declared once, under one entry-point group.

A package declares each of its workloads in its pyproject.toml:

    [project.entry-points."nebula.workloads"]
    mywork = "mypkg.workload:WORKLOAD"

WORKLOAD is a `Workload` (services/*/workload.py are examples). The entry point's name is the
workload's (`nebula demo mywork`, `nebula bench wan --scenario mywork`). Every reference in a spec is a
"module:attribute" string, imported only when it is used: `nebula --help` reads every spec, and must
import no torch (a spec module imports nothing but this one). A spec that cannot be loaded, or a
reference that cannot be imported, fails only what needs it: the jobs that name its stages, the command
it adds; the command line says so on stderr, and goes on.
"""
from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from nebula.errors import ConfigError

GROUP = "nebula.workloads"
REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:attribute


@dataclass(frozen=True)
class Workload:
    """What one workload adds. Each reference is "module:attribute"; empty fields add nothing."""

    # registered stage name (what a job file's `impl` says) -> "module:Class", a nebula.runtime.stage.Stage
    stages: Mapping[str, str] = field(default_factory=dict)
    demo: str | None = None  # a nebula.commands.demo.Demo: `nebula demo NAME`
    scenario: str | None = None  # what `nebula bench wan --scenario NAME` runs; the lab resolves it
    # `nebula COMMAND` -> "module:register", where register(subparsers) adds the command's parser
    commands: Mapping[str, str] = field(default_factory=dict)
    # `nebula data ACTION` -> "module:register", where register(data_subparsers) adds the action's parser
    data: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        refs = [*self.stages.values(), *self.commands.values(), *self.data.values(),
                *(ref for ref in (self.demo, self.scenario) if ref is not None)]
        bad = [ref for ref in refs if not isinstance(ref, str) or not REFERENCE.match(ref)]
        if bad:
            raise ConfigError(f"workload spec references {', '.join(map(repr, bad))}: each must be "
                              "'package.module:attribute'")


@dataclass(frozen=True)
class Specs:
    """The installed workloads: those whose spec loaded, and why each other one did not."""

    loaded: dict[str, Workload]
    broken: dict[str, str]  # workload name -> what went wrong, naming its entry point

    def provided(self, kind: str) -> dict[str, list[tuple[str, str]]]:
        """Name -> [(workload, reference)] for one mapping of the specs ("stages", "commands", "data"):
        more than one entry under a name is a clash, for the caller to refuse."""
        out: dict[str, list[tuple[str, str]]] = {}
        for workload, spec in sorted(self.loaded.items()):
            for name, ref in getattr(spec, kind).items():
                out.setdefault(name, []).append((workload, ref))
        return out

    def note(self) -> str:
        """A sentence on the broken specs, to append to an error that may be their doing ('' if none)."""
        return "".join(f"; workload plugin {name} cannot be loaded: {why}" for name, why in sorted(self.broken.items()))


@functools.cache
def installed() -> Specs:
    """Every spec of the group, loaded once per process (a test that installs one calls cache_clear)."""
    loaded: dict[str, Workload] = {}
    broken: dict[str, str] = {}
    found: dict[str, list[str]] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, []).append(ep.value)
        try:
            spec = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of a plugin, named
            broken[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
            continue
        if not isinstance(spec, Workload):
            broken[ep.name] = f"{ep.value} is {type(spec).__name__}, not a nebula.workload.Workload"
            continue
        loaded[ep.name] = spec
    for name, values in found.items():
        if len(values) > 1:  # two packages claim one name: neither is trusted to be the one meant
            loaded.pop(name, None)
            broken[name] = f"declared by {len(values)} installed packages ({', '.join(values)}): uninstall all but one"
    return Specs(loaded, broken)


def load(ref: str, what: str) -> Any:
    """The object a "module:attribute" reference names; a ConfigError naming `what` if it cannot be imported."""
    module_name, _, attribute = ref.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # noqa: BLE001 - ":" or ".x:C" raise ValueError/TypeError; a module may raise anything
        raise ConfigError(f"{what} ({ref}) cannot be imported: {type(exc).__name__}: {exc}") from exc


def add_commands(kind: str, subparsers, prefix: str) -> None:
    """Add the parsers the specs declare under `kind` ("commands": `nebula X`, "data": `nebula data X`) to
    `subparsers`, each by its register(subparsers). A name already taken (the framework's own, or claimed by
    two workloads) or a register function that cannot be imported is left out with a warning: the rest of
    the command line still works."""
    for name, declared in sorted(installed().provided(kind).items()):
        owners = [owner for owner, _ in declared]
        if name in subparsers.choices or len(declared) > 1:
            by = " and ".join(owners + (["the framework"] if name in subparsers.choices else []))
            warn(f"`{prefix} {name}` is claimed by {by}: left out; uninstall one of them")
            continue
        try:
            load(declared[0][1], f"`{prefix} {name}` of the workload {owners[0]}")(subparsers)
        except ConfigError as exc:
            warn(str(exc))


def warn(message: str) -> None:
    print(f"nebula: warning: {message}", file=sys.stderr)
