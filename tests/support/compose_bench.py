"""The throughput benchmark of issue 39: the tiny ABNet job under both sites' compose projects and under
`nebula site up`, one after the other in the same run on this host; site a's median step time in each, and
their ratio (the target: compose within 0.9 of site up's steps/s). The load average is recorded beside each
run, as the numbers mean little without it on a shared machine. Needs a running engine and the image:

    scripts/compose-check --bench [--json] [--steps N]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support import bench_pair
from tests.support.compose import compose_step_seconds, site_up_step_seconds

UID = 10001  # the image's user, the compose files' default
TARGET = 0.9


def measure(steps: int) -> dict:
    """Both runs, compose first (its image's page cache then warms nothing site up uses)."""
    with tempfile.TemporaryDirectory(prefix="compose-bench-") as tmp:
        roots = {run: Path(tmp) / run for run in ("compose", "site-up")}
        for root in roots.values():
            root.mkdir()
        return bench_pair.measure(steps, ("compose", lambda: compose_step_seconds(roots["compose"], steps, UID)),
                                  ("site_up", lambda: site_up_step_seconds(roots["site-up"], steps)), TARGET)


def table(result: dict) -> str:
    return bench_pair.table(result, {"site_up": "nebula site up", "compose": "docker compose"}, "compose / site up")


if __name__ == "__main__":
    raise SystemExit(bench_pair.main(__doc__, measure, table))
