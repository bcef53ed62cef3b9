"""Site b's stages on a real Slurm cluster (issue 54): munged, slurmctld and slurmd on this host, as
scripts/slurm-check starts them, and the tiny ABNet job across two sites through their gateways, site a's
stage a local process of `nebula site up`, site b's decoder a Slurm job of 2 tasks (its 2 ranks, torchrun's
variables from Slurm's). Slow; skipped where no Slurm controller answers.

    scripts/slurm-check          # installs and starts Slurm if needed, runs this file, stops what it started
"""
from __future__ import annotations

import socket
import subprocess
import time

import pytest

from tests.support.compose import wait_until
from tests.support.slurm import (
    PARTITION,
    STAGES,
    job_done,
    ledger,
    losses,
    nebula,
    processes_of,
    run_to_end,
    site_jobs,
    slurm_jobs,
    slurm_or_skip,
    stage_status,
    tiny_job,
    two_sites,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLURM = {"kind": "slurm", "partition": PARTITION, "time": "30:00", "poll": 1.0}


@pytest.fixture(autouse=True)
def cluster():
    slurm_or_skip()
    yield
    assert site_jobs("b") == [], "a test left jobs of site b in the queue"


def test_site_b_under_slurm_trains_to_the_same_losses_as_under_site_up(tmp_path):
    """The same job, the same seed: b's decoder as 2 local processes, then as one Slurm job of 2 tasks. Every
    loss of both stages is the same float, step by step; `site status` names the job and its state, `site logs`
    reads its output."""
    job = tiny_job(tmp_path / "job", steps=8)
    local = two_sites(tmp_path / "local", job, None)
    run_to_end(local)
    configs = two_sites(tmp_path / "slurm", job, SLURM)
    seen: dict[str, str] = {}

    def watch() -> bool:  # status and logs while the job runs, then the end
        status = nebula("site", "status", configs["b"]).stdout
        if "RUNNING" in status and "decoder" in status:
            seen["status"], seen["logs"] = status, nebula("site", "logs", configs["b"], "decoder").stdout
        return job_done(configs)

    try:
        for site in STAGES:
            up = nebula("site", "up", configs[site])
            assert up.returncode == 0, up.stderr
        wait_until("the job under Slurm to end", watch, timeout=400, every=1.0)
    finally:
        for site in STAGES:
            nebula("site", "down", configs[site])
    job_id = slurm_jobs(configs["b"])["decoder"]["submissions"][0]["job"]
    assert f"{job_id}" in seen.get("status", ""), f"site status never showed job {job_id} RUNNING"
    assert f"nebula: slurm job {job_id} on {socket.gethostname().split('.')[0]}: 2 rank(s)" in seen["logs"]
    print(f"\n{seen['status']}\n{seen['logs'][-600:]}")
    for site, stage in STAGES.items():
        assert ledger(configs[site], stage) == list(range(1, 9)), site
        assert losses(configs[site], stage) == losses(local[site], stage), f"{stage}: losses differ under Slurm"
    record = slurm_jobs(configs["b"])["decoder"]
    assert [s["state"] for s in record["submissions"]] == ["COMPLETED"] and record["state"] == "done", record
    print("losses, b under Slurm = b under site up:", losses(configs["b"], "decoder"))


def test_a_cancelled_stage_job_is_resubmitted_once_and_resumes_from_its_checkpoint(tmp_path):
    """`scancel` of the decoder's job mid-run, as an administrator (or a preemption) does: the supervisor sees
    CANCELLED, resubmits after its backoff, and the new job resumes from the checkpoint; every step is applied
    once at both sites. Site b's gateway runs as a Slurm job of its own, pinned to this host's node."""
    steps = 20
    job = tiny_job(tmp_path / "job", steps=steps)
    node = socket.gethostname().split(".")[0]
    configs = two_sites(tmp_path / "sites", job, {**SLURM, "gateway": "job", "gateway_node": node})
    try:
        for site in STAGES:
            up = nebula("site", "up", configs[site])
            assert up.returncode == 0, up.stderr
        checkpoints = configs["b"].parent / "run" / "decoder" / "checkpoints"
        wait_until("a checkpoint of the decoder", lambda: (stage_status(configs["b"], "decoder").get("step") or 0) >= 6
                   and any(checkpoints.glob("step-*")), timeout=300, every=0.5)
        first = slurm_jobs(configs["b"])["decoder"]["job"]
        subprocess.run(["scancel", first], check=True)
        wait_until("the job to end at both sites", lambda: job_done(configs), timeout=400)
        gateway = slurm_jobs(configs["b"])["gateway"]
        assert gateway["state"] == "running" and gateway["job"], gateway
    finally:
        for site in STAGES:
            nebula("site", "down", configs[site])
    record = slurm_jobs(configs["b"])["decoder"]
    assert [(s["job"] == first, s["state"]) for s in record["submissions"]] == [(True, "CANCELLED"),
                                                                                (False, "COMPLETED")], record
    assert record["resubmits"] == 1 and record["state"] == "done", record
    for site, stage in STAGES.items():
        assert ledger(configs[site], stage) == list(range(1, steps + 1)), f"{stage}: a step lost or applied twice"
    log = (configs["b"].parent / "run" / "logs" / "supervisor.log").read_text()
    assert f"decoder's slurm job {first} ended CANCELLED" in log and "resubmitting in 2 s" in log, log[-2000:]


def test_site_down_mid_run_leaves_no_job_and_no_process(tmp_path):
    job = tiny_job(tmp_path / "job", steps=200)
    configs = two_sites(tmp_path / "sites", job, SLURM)
    try:
        for site in STAGES:
            up = nebula("site", "up", configs[site])
            assert up.returncode == 0, up.stderr
        wait_until("the decoder to train under Slurm", lambda: (stage_status(configs["b"], "decoder").get("step")
                                                                or 0) >= 2, timeout=300, every=0.5)
        assert len(site_jobs("b")) == 1, site_jobs("b")
    finally:
        down = {site: nebula("site", "down", configs[site]) for site in STAGES}
    assert "cancelled slurm job" in down["b"].stdout or "stopped" in down["b"].stdout, down["b"].stdout
    assert site_jobs("b") == []
    time.sleep(1)
    assert processes_of(tmp_path) == [], "processes outlive `site down`"
    record = slurm_jobs(configs["b"])["decoder"]
    assert record["state"] == "stopped" and record["submissions"][-1]["state"] == "CANCELLED", record


@pytest.mark.parametrize("scheduler, key, words", [
    ({"partition": "nosuch"}, "[scheduler].partition", "no such partition"),
    ({"partition": "restricted", "account": "chemistry"}, "[scheduler].account", "does not allow it"),
    ({"sbatch": ["--bogus-option"]}, "[scheduler].sbatch", "unrecognized option"),
])
def test_a_bad_partition_account_or_option_is_a_clear_error_naming_the_key(tmp_path, scheduler, key, words):
    """`site up` refuses before it starts anything: exit 2, the key and what to do, no job, no process."""
    configs = two_sites(tmp_path / "sites", tiny_job(tmp_path / "job"), {**SLURM, **scheduler})
    up = nebula("site", "up", configs["b"])
    assert up.returncode == 2, (up.stdout, up.stderr)
    assert key in up.stderr and words in up.stderr, up.stderr
    assert site_jobs("b") == [] and processes_of(tmp_path) == []
    print(up.stderr)
