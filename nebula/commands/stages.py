"""`nebula stages [NAME] [--json]`: the stage implementations a job file's `impl` may name, and their options.

Without NAME, one line per registered stage: its name, the workload that declares it, its class. With
NAME (a registered name or "package.module:Class"), that class: what it is, its ports (or that the job
decides them), the hooks it implements, and every option a [stages.X] table may set for it, with its
type, default and limits (docs/stages.md explains each).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

HOOKS = ("examples", "after_training", "infer", "score", "choose_ranks", "optimizer_step", "state_dict")


def register(sub) -> None:
    p = sub.add_parser("stages", help="the stage implementations a job's impl may name, and their options")
    p.add_argument("name", nargs="?", help="one implementation: its ports, hooks and options")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_stages)


def _stages(args) -> int:
    # why here: torch (a stage class imports it), kept off `nebula --help`
    from nebula import workload
    from nebula.runtime.registry import registered_stages

    if args.name is None:
        declared = workload.installed().provided("stages")
        rows = [{"name": name, "workload": " ".join(w for w, _ in declared.get(name, [])) or "-",
                 "class": " ".join(ref for _, ref in declared.get(name, [])) or "-"} for name in registered_stages()]
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            width = max((len(r["name"]) for r in rows), default=4)
            print("\n".join(f"{r['name']:<{width}}  {r['workload']:<10} {r['class']}" for r in rows))
            print("\n`nebula stages NAME` shows one's ports, hooks and options (docs/stages.md)")
        return 0
    described = describe(args.name)
    print(json.dumps(described, indent=1) if args.json else _text(described))
    return 0


def describe(impl: str) -> dict[str, Any]:
    """What a job file needs to know of stage implementation `impl`."""
    from nebula.runtime.registry import resolve_stage
    from nebula.runtime.stage import Stage, options_of

    cls = resolve_stage(impl)
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    job_ports = cls.ports.__func__ is not Stage.ports.__func__  # type: ignore[attr-defined]
    return {"name": impl, "class": f"{cls.__module__}:{cls.__qualname__}", "doc": " ".join(doc.split()),
            "inputs": None if job_ports else [_port(p) for p in cls.inputs],
            "outputs": None if job_ports else [_port(p) for p in cls.outputs],
            "stats": list(cls.stats),
            "hooks": [h for h in HOOKS if getattr(cls, h, None) is not getattr(Stage, h, None)],
            "options": _fields(options_of(cls))}


def _port(port) -> str:
    return f"{port.name}: {port.dtype}, rank {port.rank}, {port.role}" + (" (optional)" if port.optional else "")


def _fields(cls: type, prefix: str = "") -> list[dict[str, Any]]:
    hints = typing.get_type_hints(cls)
    out: list[dict[str, Any]] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out.append({"key": prefix + f.name, "type": "table", "default": "-" if _default(f) else "required"})
            out += _fields(kind, f"{prefix}{f.name}.")
            continue
        bounds = {k: v for k, v in (f.metadata.get("limits") or {}).items() if v is not None}
        default = _default(f)
        row: dict[str, Any] = {"key": prefix + f.name, "type": _type_name(kind),
                               "default": default[0] if default else "required"}
        if bounds:
            row["limits"] = bounds
        out.append(row)
    return out


def _default(f: dataclasses.Field) -> tuple[Any, ...]:
    """(its default,), or () for a required key."""
    if f.default is not dataclasses.MISSING:
        return (f.default,)
    if f.default_factory is not dataclasses.MISSING:
        return (f.default_factory(),)
    return ()


def _type_name(kind: Any) -> str:
    text = str(kind).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("pathlib.Path", "path").replace("NoneType", "None")


def _text(d: dict[str, Any]) -> str:
    lines = [f"{d['name']}  ({d['class']})", f"  {d['doc']}" if d["doc"] else ""]
    if d["inputs"] is None:
        lines.append("  ports: decided by the job (the stage's `ports(job, name)`), e.g. the tensors a split finds")
    else:
        lines += [f"  in   {p}" for p in d["inputs"]] + [f"  out  {p}" for p in d["outputs"]]
    lines.append(f"  hooks: {', '.join(d['hooks']) or 'none beyond forward'}; stats: {', '.join(d['stats']) or '-'}")
    lines.append("  options ([stages.NAME] keys besides address, impl, ranks, max_ranks, device, threads, init_from):")
    width = max((len(o["key"]) for o in d["options"]), default=4)
    for o in d["options"]:
        limits = " ".join(f"{k.replace('_', ' ')} {v}" for k, v in o.get("limits", {}).items())
        default = o["default"] if o["default"] in ("required", "-") else repr(o["default"])
        lines.append(f"    {o['key']:<{width}}  {o['type']}  = {default}" + (f"  ({limits})" if limits else ""))
    return "\n".join(line for line in lines if line)
