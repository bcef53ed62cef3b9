"""The throughput benchmark of issue 39: the tiny ABNet job under both sites' compose projects and under
`nebula site up`, one after the other in the same run on this host; site a's median step time in each, and
their ratio (the target: compose within 0.9 of site up's steps/s). The load average is recorded beside each
run, as the numbers mean little without it on a shared machine. Needs a running engine and the image:

    scripts/compose-check --bench [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tests.support.compose import compose_step_seconds, site_up_step_seconds

UID = 10001  # the image's user, the compose files' default
TARGET = 0.9


def measure(steps: int) -> dict:
    """Both runs, compose first (its image's page cache then warms nothing site up uses)."""
    with tempfile.TemporaryDirectory(prefix="compose-bench-") as tmp:
        roots = {run: Path(tmp) / run for run in ("compose", "site-up")}
        for root in roots.values():
            root.mkdir()
        load_before = os.getloadavg()
        compose = compose_step_seconds(roots["compose"], steps, UID)
        load_between = os.getloadavg()
        host = site_up_step_seconds(roots["site-up"], steps)
        load_after = os.getloadavg()
    return {"steps": steps, "cpus": os.cpu_count(), "site_up_step_s": host, "compose_step_s": compose,
            "ratio": host / compose, "target": TARGET,
            "load_1m": {"before": load_before[0], "between": load_between[0], "after": load_after[0]}}


def table(result: dict) -> str:
    load = result["load_1m"]
    rows = [f"{'run':<16}{'median step s':>14}{'steps/s':>10}",
            f"{'nebula site up':<16}{result['site_up_step_s']:>14.3f}{1 / result['site_up_step_s']:>10.2f}",
            f"{'docker compose':<16}{result['compose_step_s']:>14.3f}{1 / result['compose_step_s']:>10.2f}",
            f"ratio (compose / site up steps/s): {result['ratio']:.3f} (target >= {TARGET})",
            f"{result['steps']} steps each; {result['cpus']} CPUs; load average (1 min) before "
            f"{load['before']:.1f}, between {load['between']:.1f}, after {load['after']:.1f}"]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="steps of the tiny job in each run (default 24)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    result = measure(args.steps)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
