"""The throughput benchmark of issue 54: the tiny ABNet job (site b's decoder of 2 ranks) with site b's stages as
a Slurm job, then with both sites under `nebula site up`, one after the other in the same run on this host; the
decoder's median step time in each and their ratio (the target: Slurm within 0.9 of site up's steps/s). The
load average is recorded beside each run, as the numbers mean little without it on a shared machine. Needs the
cluster scripts/slurm-check starts:

    scripts/slurm-check --bench [--json] [--steps N]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support import bench_pair
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
        slurm = {"kind": "slurm", "partition": PARTITION, "poll": 1.0}
        return bench_pair.measure(steps, ("slurm", lambda: median_step(Path(tmp) / "slurm", job, slurm)),
                                  ("site_up", lambda: median_step(Path(tmp) / "site-up", job, None)), TARGET)


def table(result: dict) -> str:
    return bench_pair.table(result, {"site_up": "nebula site up", "slurm": "b under Slurm"}, "Slurm / site up")


if __name__ == "__main__":
    raise SystemExit(bench_pair.main(__doc__, measure, table))
