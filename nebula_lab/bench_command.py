"""`nebula bench NAME`: benchmarks, one module each in nebula_lab/bench/<name>.py exposing `register`."""
from __future__ import annotations

import functools
import importlib

BENCHMARKS = [
    "audit",
    "chaos",
    "codecs",
    "flood",
    "transport",
    "wan",
]


def register(sub) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (prints a table, or JSON with --json)")
    bench_sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(f"nebula_lab.bench.{name}").register(bench_sub)
    for bench in bench_sub.choices.values():  # every benchmark that starts sites or a WAN stops them on SIGTERM
        bench.set_defaults(func=_stopped_by_sigterm(bench.get_default("func")))


def _stopped_by_sigterm(run):
    """`run` with SIGTERM raising KeyboardInterrupt, as Ctrl-C does: a killed benchmark (a `timeout`, a
    `kill`) runs its `finally` blocks and stops the gateways, stages and emulated links it started,
    where it used to die at once and leave them running."""
    @functools.wraps(run)
    def stopping(args):
        # why here: torch, kept off `nebula --help`
        from nebula.site.local import interrupted_by_sigterm
        with interrupted_by_sigterm():
            return run(args)
    return stopping
