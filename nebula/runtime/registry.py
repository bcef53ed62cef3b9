"""Stage implementations chosen by name: a registry that rejects duplicates, fed by entry points.

A job file names a stage either by a registered name (`impl = "example-source"`) or by an import path
(`impl = "mypkg.mod:MyStage"`), so a user swaps a stage without touching Nebula.
"""
from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from nebula.errors import ConfigError

ENTRY_POINT_GROUP = "nebula.stages"
_STAGES: dict[str, type] = {}
_loaded_entry_points = False
_lock = threading.RLock()


def register_stage(name: str):
    def decorate(cls: type) -> type:
        if name in _STAGES and _STAGES[name] is not cls:
            raise ConfigError(f"stage name {name!r} is already registered by {_STAGES[name].__qualname__}")
        _STAGES[name] = cls
        cls.stage_name = name
        return cls
    return decorate


def _load_entry_points() -> None:
    global _loaded_entry_points
    with _lock:  # two stages resolved at once (one-site runs) must both see the loaded registry
        if not _loaded_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    ep.load()  # importing the module runs its @register_stage
                except Exception as exc:  # noqa: BLE001 - any import failure of a plugin, named
                    raise ConfigError(f"stage plugin {ep.name} ({ep.value}) cannot be imported: "
                                      f"{type(exc).__name__}: {exc}") from exc
            _loaded_entry_points = True


def resolve_stage(impl: str) -> type:
    """A registered name or `package.module:Class` -> the stage class (a nebula.runtime.stage.Stage)."""
    from nebula.runtime.stage import Stage
    if ":" in impl:
        module_name, _, attr = impl.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"stage impl {impl!r} cannot be imported: {exc}") from exc
    else:
        _load_entry_points()
        if impl not in _STAGES:
            raise ConfigError(f"unknown stage {impl!r}; registered: {', '.join(sorted(_STAGES)) or 'none'} "
                              "(or give 'package.module:Class')")
        cls = _STAGES[impl]
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"stage impl {impl!r} is {cls!r}, not a subclass of nebula.runtime.stage.Stage")
    return cls


def registered_stages() -> list[str]:
    _load_entry_points()
    return sorted(_STAGES)
