"""Typed, checked configuration: a TOML table (or a JSON body) -> a frozen dataclass, or a ConfigError.

Every option Nebula reads is a field of a dataclass; `build(cls, table, where)` checks each value
against the field's annotation and its `limits(...)` metadata, and refuses unknown keys, so
`lr = "fast"`, `seed = "abc"`, `warmup_steps = -5` or `window_messages = "8"` fail when the file
loads, naming the file and the key, instead of deep inside a run:

    @dataclass(frozen=True, kw_only=True)
    class Options:
        lr: float = field(default=5e-4, metadata=limits(above=0, below=1))
        warmup_steps: int = field(default=50, metadata=limits(at_least=0))
        objective: Literal["ar", "cmlm"] = "ar"
        max_train_examples: int | None = None

    options = build(Options, {"lr": 1e-3}, where="job.toml: [stages.src]")

Supported annotations: bool, int, float (an int is accepted), str, Path (str in the file), None,
`X | None`, Literal[...], tuple[X, ...], list[X], dict[str, X] and nested dataclasses (a table).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import tomllib

from nebula.errors import ConfigError

_NOTHING = object()


def limits(*, at_least: float | None = None, above: float | None = None, at_most: float | None = None,
           below: float | None = None, hint: str = "") -> dict[str, Any]:
    """Field metadata: the numeric range a value must lie in (and what to say when it does not)."""
    return {"limits": {"at_least": at_least, "above": above, "at_most": at_most, "below": below}, "hint": hint}


def read_toml(path: str | os.PathLike, what: str, missing: str = "") -> dict[str, Any]:
    """The tables of TOML file `path`, or a ConfigError naming it as `what` (e.g. "job file"); `missing`:
    what to add when it does not exist (how to make one)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path} does not exist{missing}") from exc
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from exc


def build(cls: type, table: Any, where: str, renamed: Mapping[str, str] | None = None):
    """An instance of dataclass `cls` from `table`; `renamed` maps a key that moved to a hint where it went."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table of keys, got {_show(table)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(table) - set(known))
    if unknown:
        key = unknown[0]
        if renamed and key in renamed:
            raise ConfigError(f"{where}.{key}: {renamed[key]}")
        raise ConfigError(f"{where}: unknown key {key!r}{_did_you_mean(key, known)}; "
                          f"allowed: {', '.join(sorted(known)) or 'none'}")
    values = {}
    for name, f in known.items():
        if name in table:
            values[name] = check(hints[name], table[name], f"{where}.{name}")
            _check_limits(f, values[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: `{name}` is required")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except (TypeError, ValueError) as exc:  # a __post_init__ check that is not a ConfigError yet
        raise ConfigError(f"{where}: {exc}") from exc


def check(annotation: Any, value: Any, where: str) -> Any:
    """`value` converted to `annotation` (Path from str, tuple from list, float from int), or ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return check(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {_show(value)} is none of "
                          f"{', '.join(_name(a) for a in args)}")
    if origin is typing.Literal:
        if value not in args or type(value) is not type(next(a for a in args if a == value)):
            raise ConfigError(f"{where}: {_show(value)} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_show(value)}")
        item = args[0] if args else Any
        items = [check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {_show(value)}")
        item = args[1] if len(args) == 2 else Any
        return {str(k): check(item, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return build(annotation, value, where)
    return _scalar(annotation, value, where)


def _scalar(annotation: Any, value: Any, where: str) -> Any:
    if annotation is bool:
        if type(value) is not bool:
            raise ConfigError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if annotation is int:
        if type(value) is not int:
            raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
        return value
    if annotation is float:
        if type(value) not in (int, float):
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_show(value)}")
        return value
    if annotation is Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise ConfigError(f"{where}: expected a path (a string), got {_show(value)}")
        return Path(value)
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected nothing, got {_show(value)}")
        return None
    raise TypeError(f"{where}: the annotation {annotation!r} is not supported by nebula.config")


def _check_limits(f: dataclasses.Field, value: Any, where: str) -> None:
    bounds = f.metadata.get("limits")
    if not bounds or value is None:
        return
    low, above, high, below = (bounds[k] for k in ("at_least", "above", "at_most", "below"))
    ok = ((low is None or value >= low) and (above is None or value > above)
          and (high is None or value <= high) and (below is None or value < below))
    if not ok:
        parts = [f">= {low}" if low is not None else "", f"> {above}" if above is not None else "",
                 f"<= {high}" if high is not None else "", f"< {below}" if below is not None else ""]
        hint = f" ({f.metadata['hint']})" if f.metadata.get("hint") else ""
        raise ConfigError(f"{where}: {_show(value)} must be {' and '.join(p for p in parts if p)}{hint}")


def _did_you_mean(key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", repr(annotation))
