"""The throughput benchmark of issue 54: the tiny ABNet job (site b's decoder of 2 ranks) with site b's stages as
a Slurm job, then with both sites under `nebula site up`, one after the other in the same run on this host; the
decoder's median step time in each and their ratio (the target: Slurm within 0.9 of site up's steps/s). The
load average is recorded beside each run, as the numbers mean little without it on a shared machine. Needs the
cluster scripts/slurm-check starts:

    scripts/slurm-check --bench [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tests.support.compose import step_seconds
from tests.support.slurm import PARTITION, run_to_end, tiny_job, two_sites

TARGET = 0.9


def median_step(root: Path, job: Path, scheduler: dict | None) -> float:
    configs = two_sites(root, job, scheduler)
    run_to_end(configs, timeout=900)
    return step_seconds(configs["b"].parent / "run" / "decoder" / "metrics.jsonl")


def measure(steps: int) -> dict:
    """Both runs of one job file, Slurm first."""
    with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
        job = tiny_job(Path(tmp) / "job", steps=steps, checkpoint_every=max(2, steps // 4))
        load_before = os.getloadavg()
        slurm = median_step(Path(tmp) / "slurm", job, {"kind": "slurm", "partition": PARTITION, "poll": 1.0})
        load_between = os.getloadavg()
        host = median_step(Path(tmp) / "site-up", job, None)
        load_after = os.getloadavg()
    return {"steps": steps, "cpus": os.cpu_count(), "site_up_step_s": host, "slurm_step_s": slurm,
            "ratio": host / slurm, "target": TARGET,
            "load_1m": {"before": load_before[0], "between": load_between[0], "after": load_after[0]}}


def table(result: dict) -> str:
    load = result["load_1m"]
    rows = [f"{'run':<16}{'median step s':>14}{'steps/s':>10}",
            f"{'nebula site up':<16}{result['site_up_step_s']:>14.3f}{1 / result['site_up_step_s']:>10.2f}",
            f"{'b under Slurm':<16}{result['slurm_step_s']:>14.3f}{1 / result['slurm_step_s']:>10.2f}",
            f"ratio (Slurm / site up steps/s): {result['ratio']:.3f} (target >= {TARGET})",
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
