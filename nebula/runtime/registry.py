"""Stage implementations chosen by name: a registry that rejects duplicates, fed by entry points.

A job file names a stage either by a registered name (`impl = "example-source"`) or by an import path
(`impl = "mypkg.mod:MyStage"`), so a user swaps a stage without touching Nebula.
"""
from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points
from typing import Callable, TypeVar

from nebula.errors import ConfigError
from nebula.runtime.stage import Stage

ENTRY_POINT_GROUP = "nebula.stages"
S = TypeVar("S", bound=Stage)
_STAGES: dict[str, type[Stage]] = {}
_lock = threading.RLock()


def register_stage(name: str) -> Callable[[type[S]], type[S]]:
    def decorate(cls: type[S]) -> type[S]:
        if name in _STAGES and _STAGES[name] is not cls:
            raise ConfigError(f"stage name {name!r} is already registered by {_STAGES[name].__qualname__}")
        _STAGES[name] = cls
        cls.stage_name = name
        return cls
    return decorate


def _load_entry_point(name: str) -> None:
    """Import the plugin that declares stage `name` (its module's @register_stage runs), and only that
    one: a broken plugin fails the jobs that use it, not every job of the site."""
    with _lock:  # two stages resolved at once (one-site runs) must both see the loaded registry
        if name in _STAGES:
            return
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            try:
                ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure of a plugin, named
                raise ConfigError(f"stage plugin {ep.name} ({ep.value}) cannot be imported: "
                                  f"{type(exc).__name__}: {exc}") from exc


def resolve_stage(impl: str) -> type[Stage]:
    """A registered name or `package.module:Class` -> the stage class (a nebula.runtime.stage.Stage)."""
    if ":" in impl:
        module_name, _, attr = impl.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # noqa: BLE001 - ":" or ".x:C" raise ValueError/TypeError; a module may raise anything
            raise ConfigError(f"stage impl {impl!r} cannot be imported: {type(exc).__name__}: {exc} "
                              "(expected 'package.module:Class')") from exc
    else:
        _load_entry_point(impl)
        if impl not in _STAGES:
            raise ConfigError(f"unknown stage {impl!r}; registered: {', '.join(registered_stages()) or 'none'} "
                              "(or give 'package.module:Class')")
        cls = _STAGES[impl]
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"stage impl {impl!r} is {cls!r}, not a subclass of nebula.runtime.stage.Stage")
    return cls


def registered_stages() -> list[str]:
    """Every stage name an installed package declares or this process registered (nothing imported)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(_STAGES))
