"""`nebula ...`: the command line of Nebula and of the workloads installed with it.

Each framework command lives in nebula/commands/<name>.py; a workload (or the lab) adds its own
through its spec in the entry-point group `nebula.workloads` (nebula/workload.py:
`commands = {"NAME": "package.module:register"}`).

A command module exposes `register(subparsers)`; it must import only argparse-level code at
module import time (heavy imports such as torch go inside the handler) so `nebula --help` is fast.

Every option `--foo-bar` of every command takes its default from the environment variable
NEBULA_FOO_BAR when that is set, as torchrun's options do from PET_*: an option given on the command
line wins, and a bad value is argparse's usage error naming the variable (`Parser`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import textwrap

from nebula import __version__, workload
from nebula.errors import EXIT_ERROR, EXIT_FIX_FIRST, FIX_FIRST, NebulaError
from nebula.shipped import docs_dir

COMMANDS = [
    "demo",
    "data",
    "keys",
    "audit",
    "stage",
    "stages",
    "site",
    "health",
    "user",
    "job",
    "gateway",
]
ENV_PREFIX = "NEBULA_"
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}

DESCRIPTION = """\
Nebula trains one deep-learning model across remote sites (clusters) joined by slow WAN links
(Nebula-I): the model is split into stages, each stage runs as a service at one site, and the stages
exchange compressed tensors over encrypted ZeroMQ through each site's one gateway."""

# The main commands in the order a user meets them, for `nebula --help`; one not installed is left out.
GUIDE = [
    ("demo", "try it: a workload across two sites on this machine, end to end"),
    ("data", "prepare a workload's data; register data sets and grant jobs access"),
    ("keys", "a site's CA and certificates; trust between sites"),
    ("site", "run a site: init, up, status, logs, down"),
    ("user", "the accounts that submit jobs"),
    ("job", "submit a job, list, stop it, read its logs"),
    ("stage", "one stage of a job as a service, or every stage in one process"),
    ("stages", "the stage implementations a job may name, and their options"),
    ("health", "is a service up (compose health checks)"),
    ("audit", "verify the site's tamper-evident audit log"),
]


def env_name(action: argparse.Action) -> str | None:
    """NEBULA_FOO_BAR for an option --foo-bar (its first long form); None for positionals, help, version."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return ENV_PREFIX + longs[0][2:].upper().replace("-", "_")


def env_value(action: argparse.Action, text: str):
    """`text` as the option would have stored it from the command line; ValueError if it is no such value."""
    if action.nargs == 0:  # a flag: store_true/false/const, count, --x/--no-x
        if isinstance(action, argparse._CountAction):
            return _one(argparse.Action([], "", type=int), text)
        word = text.strip().lower()
        boolean = isinstance(action, argparse.BooleanOptionalAction)
        if word in TRUE | FALSE:
            return (word in TRUE) if boolean else (action.const if word in TRUE else action.default)
        raise ValueError(f"expected one of {', '.join(sorted(TRUE))} or {', '.join(sorted(FALSE - {''}))}")
    if action.nargs is None and not isinstance(action, argparse._AppendAction) or action.nargs == "?":
        return _one(action, text)
    values = [_one(action, word) for word in shlex.split(text)]  # several values: separated by spaces
    n = action.nargs if isinstance(action.nargs, int) else 1
    if isinstance(action, argparse._AppendAction):  # each occurrence of the option: n values
        if len(values) % n:
            raise ValueError(f"expected groups of {n} values, got {len(values)}")
        return [values[i:i + n] if isinstance(action.nargs, int) else values[i] for i in range(0, len(values), n)]
    if action.nargs == "+" and not values or isinstance(action.nargs, int) and len(values) != n:
        raise ValueError(f"expected {'at least one' if action.nargs == '+' else n} value(s), got {len(values)}")
    return values


def _one(action: argparse.Action, text: str):
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid {getattr(action.type, '__name__', repr(action.type))} value: {text!r}") from exc
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(repr, action.choices))})")
    return value


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to their NEBULA_* variables. Sub-command parsers are of this
    class too (add_subparsers makes its parent's class), and each reads the variables of its own options
    only when it parses: a bad value for an option of another command is no error."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = argparse.Namespace() if namespace is None else namespace
        from_env = {}  # dest -> the value the variable gave (argparse keeps a value already in the namespace)
        for action in self._actions:
            name = env_name(action)
            if name is not None and name in os.environ:
                try:
                    from_env[action.dest] = env_value(action, os.environ[name])
                except ValueError as exc:
                    self.error(f"environment variable {name}={os.environ[name]!r} (for {action.option_strings[0]}):"
                               f" {exc}")
                setattr(namespace, action.dest, from_env[action.dest])
                action.required = False
        namespace, rest = super().parse_known_args(args, namespace)
        for action in self._actions:  # an append option given on the command line replaces the variable's list
            env = from_env.get(action.dest)
            got = getattr(namespace, action.dest, None)
            if isinstance(action, argparse._AppendAction) and env is not None and got is not env:
                setattr(namespace, action.dest, got[len(env):])
        return namespace, rest

    def format_help(self) -> str:
        names = [(action.option_strings[0], name) for action in self._actions if (name := env_name(action))]
        if not names:
            return super().format_help()
        example = next(((o, n) for o, n in names if "-" in o[2:]), names[0])
        note = (f"Each option also takes its default from the environment: {example[0]} from {example[1]}, and "
                f"likewise for the others; an option given here wins.")
        now = [f"{name}={os.environ[name]}" for _, name in names if name in os.environ]
        return super().format_help() + "\n" + self._fill(note + (f" Set now: {', '.join(now)}." if now else ""))

    def _fill(self, text: str) -> str:
        width = self._get_formatter()._width
        return textwrap.fill(text, width, break_on_hyphens=False, break_long_words=False) + "\n"  # paths whole


def guide(commands: dict) -> str:
    """The epilog of `nebula --help`: the main commands in order of use, the environment, the docs."""
    width = max(len(name) for name, _ in GUIDE) + len("nebula ")
    steps = "\n".join(f"  {'nebula ' + name:<{width}}  {what}" for name, what in GUIDE if name in commands)
    docs = docs_dir()
    guides = [f"{name} ({what})" for name, what in (("operate.md", "running a site"), ("runtime.md", "job files"))
              if docs and (docs / name).is_file()]
    return (f"start here, in this order:\n{steps}\n\n"
            "environment: every option --foo-bar of a command also takes its default from NEBULA_FOO_BAR\n"
            "  (e.g. NEBULA_RUN_DIR=runs/mine for --run-dir); an option given on the command line wins.\n\n"
            f"docs: `nebula COMMAND --help`; the guides in {docs or 'docs/ of the source repository'}"
            f"{': ' + ', '.join(guides) if guides else ''}; the project's README.md")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="nebula", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, why in sorted(workload.installed().broken.items()):  # said once, whatever the command
        workload.warn(f"workload plugin {name} cannot be loaded ({why}): its stages, demo and commands are missing")
    for name in COMMANDS:
        importlib.import_module(f"nebula.commands.{name}").register(sub)
    workload.add_commands("commands", sub, "nebula")
    parser.epilog = guide(sub.choices)
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
