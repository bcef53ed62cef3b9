"""`nebula ...`: one entry point; each top-level command lives in nebula/commands/<name>.py.

A command module exposes `register(subparsers)`; it must import only argparse-level code at
module import time (heavy imports such as torch go inside the handler) so `nebula --help` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from nebula.errors import NebulaError

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
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
