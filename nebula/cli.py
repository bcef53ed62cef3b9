"""`nebula ...`: one entry point; each top-level command lives in nebula/commands/<name>.py.

A command module exposes `register(subparsers)`; it must import only argparse-level code at
module import time (heavy imports such as torch go inside the handler) so `nebula --help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from nebula.errors import ConfigError, DataError, NebulaError, StageError

EXIT_ERROR = 2  # failed; running it again may succeed (a link or a peer failed)
EXIT_FIX_FIRST = 3  # a service (supervised=True) that fails the same way until its cause is fixed:
                    # supervisors do not restart it
FIX_FIRST = (ConfigError, DataError, StageError)

COMMANDS = [
    "bench",
    "gateway",
    "data",
    "keys",
    "audit",
    "stage",
    "demo",
    "translate",
    "wan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nebula", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"nebula.commands.{name}").register(sub)
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
