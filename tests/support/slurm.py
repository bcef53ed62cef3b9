"""Two sites as their operators run them, site b's stages on the Slurm cluster scripts/slurm-check starts on this
host: `nebula site init` and `site trust` per site, b's [scheduler] table, `site up`, `site down`, and what the
stages wrote. Used by tests/deploy/test_slurm.py and the benchmark (tests/support/slurm_bench.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nebula.site.ports import free_port
from tests.support.compose import host_sites, wait_until
from tests.support.sites import write_job

PARTITION = "nebula"  # scripts/slurm-check's default partition; "restricted" allows the account "physics" only
STAGES = {"a": "encoder", "b": "decoder"}  # the tiny ABNet job's stage at each site


def slurm_or_skip() -> None:
    if shutil.which("sbatch") is None or subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        pytest.skip("no Slurm controller answers here (`scontrol ping`): scripts/slurm-check installs and starts one")


def tiny_job(root: Path, steps: int = 8, decoder_ranks: int = 2, checkpoint_every: int = 2) -> Path:
    """tests/e2e/jobs/tiny.toml with `steps`, the decoder's ranks (Slurm tasks) and its checkpoint interval."""
    root.mkdir(parents=True, exist_ok=True)
    return write_job(root, {"\nsteps = 8\n": f"\nsteps = {steps}\n",
                            "checkpoint_every = 2": f"checkpoint_every = {checkpoint_every}",
                            'address = "b/decoder/0"': f'address = "b/decoder/0"\nranks = {decoder_ranks}'})


def two_sites(root: Path, job: Path, scheduler: dict[str, object] | None) -> dict[str, Path]:
    """Sites a and b under root, trusting each other, each running `job`'s stages; b's [scheduler] is
    `scheduler` (None: local processes). -> site -> its site.toml."""
    configs = host_sites(root, job, {site: (free_port(), free_port()) for site in STAGES})
    if scheduler is not None:
        set_scheduler(configs["b"], scheduler)
    return configs


def set_scheduler(config: Path, scheduler: dict[str, object]) -> None:
    """The operator's edit: a [scheduler] table at the end of the site config."""
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in scheduler.items())
    text = config.read_text().split("\n[scheduler]\n")[0]
    config.write_text(f"{text.rstrip()}\n\n[scheduler]\n{table}\n")


def nebula(*args: object, timeout: float = 180) -> subprocess.CompletedProcess:
    """`nebula ARGS` as an operator runs it; its exit code and output, for the caller to judge."""
    return subprocess.run([sys.executable, "-m", "nebula.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def stage_status(config: Path, stage: str) -> dict:
    try:
        return json.loads((config.parent / "run" / "status" / f"{stage}.json").read_text())
    except (OSError, ValueError):
        return {}


def job_done(configs: dict[str, Path]) -> bool:
    """Both stages say they are done and, b on Slurm, the decoder's job ended COMPLETED (its ranks exited 0)."""
    jobs = configs["b"].parent / "run" / "slurm" / "jobs.json"
    return (all(stage_status(configs[s], STAGES[s]).get("state") == "done" for s in STAGES)
            and (not jobs.exists() or slurm_jobs(configs["b"])["decoder"]["state"] == "done"))


def run_to_end(configs: dict[str, Path], timeout: float = 400) -> None:
    """`site up` at both sites, wait until the job is done, `site down` at both (also on failure)."""
    try:
        for site in STAGES:
            up = nebula("site", "up", configs[site])
            assert up.returncode == 0, f"site up {site}:\n{up.stdout}\n{up.stderr}"
        wait_until("the job to end at both sites", lambda: job_done(configs), timeout=timeout)
    finally:
        for site in STAGES:
            nebula("site", "down", configs[site])


def losses(config: Path, stage: str) -> list[tuple[int, float]]:
    metrics = config.parent / "run" / stage / "metrics.jsonl"
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())
            if r.get("kind") == "step" and "loss" in r]


def ledger(config: Path, stage: str) -> list[int]:
    return [step for step, _ in json.loads((config.parent / "run" / stage / "ledger.json").read_text())["steps"]]


def slurm_jobs(config: Path) -> dict:
    """The site's job ledger (nebula.site.slurm_jobs), by service."""
    return {s["name"]: s for s in json.loads((config.parent / "run" / "slurm" / "jobs.json").read_text())["services"]}


def site_jobs(site: str) -> list[str]:
    """Every job of site `site` the controller holds that is not over: "ID STATE NAME" lines."""
    done = subprocess.run(["squeue", "--noheader", "--format=%i %T %j"], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if f" nebula.{site}." in line]


def processes_of(root: Path) -> list[str]:
    """Processes whose command line names a path under root (the sites' services, stage jobs' ranks)."""
    done = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if str(root) in line and "ps -eo" not in line]
