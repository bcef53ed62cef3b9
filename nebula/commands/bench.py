"""`nebula bench NAME`: benchmarks, one module each in nebula/bench/<name>.py exposing `register`."""
from __future__ import annotations

import importlib

BENCHMARKS = [
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
        importlib.import_module(f"nebula.bench.{name}").register(bench_sub)
