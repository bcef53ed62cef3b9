"""Stage implementations chosen by name: a registry that rejects duplicates, fed by the workload specs.

A job file names a stage either by a registered name (`impl = "example-source"`), which an installed
workload's spec maps to its class (nebula.workload), or by an import path (`impl = "mypkg.mod:MyStage"`),
so a user swaps a stage without touching Nebula.
"""
from __future__ import annotations

import importlib
import threading
from typing import Callable, TypeVar

from nebula import workload
from nebula.errors import ConfigError
from nebula.runtime.stage import Stage

S = TypeVar("S", bound=Stage)
_STAGES: dict[str, type[Stage]] = {}
_lock = threading.RLock()


def register_stage(name: str) -> Callable[[type[S]], type[S]]:
    """Register a class under `name` in this process (what a spec's entry does when a job first names it)."""
    def decorate(cls: type[S]) -> type[S]:
        if name in _STAGES and _STAGES[name] is not cls:
            raise ConfigError(f"stage name {name!r} is already registered by {_STAGES[name].__qualname__}")
        if cls.stage_name and _STAGES.get(cls.stage_name) is cls and cls.stage_name != name:
            # one name per class: its stage_name is what errors and logs call it
            raise ConfigError(f"stage class {cls.__qualname__} is registered as {cls.stage_name!r} already, not "
                              f"also as {name!r}: subclass it for a second name")
        _STAGES[name] = cls
        cls.stage_name = name
        return cls
    return decorate


def _load_declared(name: str) -> None:
    """Import the class the workload specs declare for stage `name`, and only that one: a broken plugin
    fails the jobs that use it, not every job of the site."""
    with _lock:  # two stages resolved at once (one-site runs) must both see the loaded registry
        if name in _STAGES:
            return
        declared = workload.installed().provided("stages").get(name, [])
        if len(declared) > 1:
            owners = " and ".join(f"{owner} ({ref})" for owner, ref in declared)
            raise ConfigError(f"stage name {name!r} is declared by the workloads {owners}: uninstall one, or "
                              "name the class in the job file (impl = 'package.module:Class')")
        for _, ref in declared:
            register_stage(name)(_checked(name, workload.load(ref, f"stage plugin {name}")))


def resolve_stage(impl: str) -> type[Stage]:
    """A registered name or `package.module:Class` -> the stage class (a nebula.runtime.stage.Stage)."""
    if ":" in impl:
        module_name, _, attr = impl.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # noqa: BLE001 - ":" or ".x:C" raise ValueError/TypeError; a module may raise anything
            raise ConfigError(f"stage impl {impl!r} cannot be imported: {type(exc).__name__}: {exc} "
                              "(expected 'package.module:Class')") from exc
        return _checked(impl, cls)
    _load_declared(impl)
    if impl not in _STAGES:
        raise ConfigError(f"unknown stage {impl!r}; registered: {', '.join(registered_stages()) or 'none'} "
                          f"(or give 'package.module:Class'){workload.installed().note()}")
    return _STAGES[impl]


def _checked(impl: str, cls: object) -> type[Stage]:
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"stage impl {impl!r} is {cls!r}, not a subclass of nebula.runtime.stage.Stage")
    return cls


def registered_stages() -> list[str]:
    """Every stage name an installed workload declares or this process registered (nothing imported)."""
    return sorted(set(workload.installed().provided("stages")) | set(_STAGES))
