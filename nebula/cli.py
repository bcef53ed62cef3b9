"""`nebula ...`: the command line of Nebula and of the workloads installed with it.

Each framework command lives in nebula/commands/<name>.py, and a
workload adds its own commands through the entry-point
group `nebula.commands` (name = "package.module:register").

A command module exposes `register(subparsers)`; it must import only argparse-level code at
module import time (heavy imports such as torch go inside the handler) so `nebula --help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from nebula.errors import EXIT_ERROR, EXIT_FIX_FIRST, FIX_FIRST, NebulaError

COMMANDS = [
    "bench",
    "keys",
    "audit",
    "stage",
    "wan",
    "user",
]
ENTRY_POINT_GROUP = "nebula.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nebula", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"nebula.commands.{name}").register(sub)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        if ep.name in COMMANDS:
            raise NebulaError(f"workload command {ep.name!r} ({ep.value}) clashes with a built-in command")
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except NebulaError as exc:
        print(f"nebula: error: {exc}", file=sys.stderr)
        fix_first = getattr(args, "supervised", False) and isinstance(exc, FIX_FIRST)
        return EXIT_FIX_FIRST if fix_first else EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
