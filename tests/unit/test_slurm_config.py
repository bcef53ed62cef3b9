"""[scheduler] kind = "slurm" without a cluster: the table's checks (each refusal names the key and what to
do), the batch script `site up` submits (bash parses it; each task's command, run by bash with the variables
srun gives a task, sets torchrun's), and what the supervisor does at a job's end. The cluster itself runs in
tests/deploy/test_slurm.py (scripts/slurm-check)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.site.config import load_site_config, parse_site_config, write_site_config
from nebula.site.scheduler import SchedulerConfig
from nebula.site.service import ServiceSpec
from nebula.site.site import site_services
from nebula.site.slurm import JobState, _exit_code, batch_script, rank_command, sbatch_options
from nebula.site.slurm_jobs import SlurmJobs, _key, scheduled
from nebula.site.status import format_status

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "sites" / "b-slurm.toml"


def site_table(run: Path, **scheduler) -> dict:
    return {"site": {"name": "b", "credentials": str(run / "credentials"), "run": str(run)},
            "gateway": {"internal": "tcp://127.0.0.1:5701", "external": "tcp://127.0.0.1:5700"},
            "scheduler": scheduler}


def test_the_shipped_slurm_site_runs_its_decoder_as_a_job_and_its_gateway_at_the_edge():
    site = load_site_config(EXAMPLE)
    assert (site.scheduler.kind, site.scheduler.partition, site.scheduler.gpus_per_rank) == ("slurm", "gpu", 1)
    services = site_services(site, EXAMPLE)
    assert [(s.name, scheduled(site, s)) for s in services] == [("gateway", False), ("decoder", True)]
    options = sbatch_options(services[1], site.scheduler, site.name)
    assert {"--job-name=nebula.b.decoder", "--partition=gpu", "--account=nebula", "--time=1-00:00:00",
            "--gpus-per-task=1", "--ntasks=1", "--nodes=1", "--no-requeue", "--qos=normal"} <= set(options)


@pytest.mark.parametrize("scheduler, words", [
    ({"partition": "gpu"}, "`partition` is an option of kind = \"slurm\""),
    ({"kind": "pbs"}, "[scheduler].kind: 'pbs' is not one of 'local', 'slurm'"),
    ({"kind": "slurm", "time": "2 hours"}, "`time` = '2 hours' is not a Slurm time limit"),
    ({"kind": "slurm", "gateway": "job"}, "name it with gateway_node = \"NODE\""),
    ({"kind": "slurm", "gateway_node": "gw"}, "`gateway` is \"edge\""),
    ({"kind": "slurm", "sbatch": ["qos=high"]}, "write each as sbatch reads it"),
    ({"kind": "slurm", "partiton": "gpu"}, "unknown key 'partiton' (did you mean 'partition'?)"),
    ({"kind": "slurm", "max_resubmits": -1}, "[scheduler].max_resubmits: -1 must be >= 0"),
])
def test_a_bad_scheduler_table_names_the_file_and_the_key(tmp_path, scheduler, words):
    with pytest.raises(ConfigError) as caught:
        parse_site_config(site_table(tmp_path, **scheduler), source="b.toml")
    assert "b.toml [scheduler]" in str(caught.value) and words in str(caught.value)


def test_time_limits_in_every_form_sbatch_reads_are_accepted():
    for limit in ("90", "30:00", "2:00:00", "1-12", "1-12:30", "1-12:30:00", "UNLIMITED"):
        assert SchedulerConfig(kind="slurm", time=limit).time == limit


def test_the_writer_keeps_the_scheduler_table(tmp_path):
    site = load_site_config(EXAMPLE)
    path = tmp_path / "b.toml"
    assert write_site_config(path, site).scheduler == site.scheduler
    assert load_site_config(path).scheduler == site.scheduler


def spec(run: Path, ranks: int) -> ServiceSpec:
    return ServiceSpec(name="decoder", argv=("/usr/bin/env",), run=run, env={"NEBULA_ADDRESS": "b/decoder/0"},
                       ranks=ranks)


def test_ranks_are_spread_over_nodes_as_ranks_per_node_says_and_must_divide(tmp_path):
    scheduler = SchedulerConfig(kind="slurm", ranks_per_node=4)
    assert {"--nodes=2", "--ntasks=8", "--ntasks-per-node=4"} <= set(sbatch_options(spec(tmp_path, 8), scheduler, "b"))
    with pytest.raises(ConfigError, match="ranks_per_node = 4 does not divide stage decoder's ranks = 6"):
        sbatch_options(spec(tmp_path, 6), scheduler, "b")


def test_the_gateway_job_is_pinned_to_its_node(tmp_path):
    scheduler = SchedulerConfig(kind="slurm", gateway="job", gateway_node="gw-b")
    gateway = dataclasses.replace(spec(tmp_path, 1), name="gateway")
    assert "--nodelist=gw-b" in sbatch_options(gateway, scheduler, "b", gateway=True)
    assert "--nodelist=gw-b" not in sbatch_options(spec(tmp_path, 1), scheduler, "b")


def test_the_batch_script_parses_and_exports_what_the_local_supervisor_sets(tmp_path):
    script = batch_script(spec(tmp_path, 2), SchedulerConfig(kind="slurm", partition="gpu"), "b")
    path = tmp_path / "decoder.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --ntasks=2" in script
    assert f"NEBULA_STATUS_FILE={tmp_path}/status/decoder.json" in script and "NEBULA_ADDRESS=b/decoder/0" in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script


@pytest.mark.parametrize("procid", [0, 1])
def test_each_task_gets_torchruns_variables_from_slurms_and_rank_r_logs_apart(tmp_path, procid):
    """The task command, run by bash as srun runs it, with the variables srun gives task `procid` of 2."""
    (tmp_path / "logs").mkdir()
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid),
           "SLURM_NTASKS_PER_NODE": "2"}
    done = subprocess.run(["bash", "-c", rank_command(spec(tmp_path, 2)), "nebula-rank", "env"], env=env,
                          capture_output=True, text=True, check=True)
    out = done.stdout if procid == 0 else (tmp_path / "logs" / "decoder.rank1.log").read_text()
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert (seen["RANK"], seen["LOCAL_RANK"], seen["LOCAL_WORLD_SIZE"]) == (str(procid), str(procid), "2")
    assert (done.stdout == "") == (procid == 1)


def test_sacct_exit_codes_and_sbatch_refusals_are_read_as_the_operator_would():
    assert (_exit_code("3:0"), _exit_code("0:15"), _exit_code("0:0"), _exit_code("")) == (3, 143, 0, None)
    assert _key("sbatch: error: invalid partition specified: x") == "check [scheduler].partition"
    assert _key("sbatch: error: Invalid --time specification") == "check [scheduler].time"
    assert _key("sbatch: error: Invalid generic resource (gres) specification") == "check [scheduler].gpus_per_rank"
    assert _key("sbatch: unrecognized option '--bogus'") == "check [scheduler].sbatch, the extra options"


def jobs(tmp_path: Path, max_resubmits: int = 2) -> SlurmJobs:
    site = parse_site_config(site_table(tmp_path, kind="slurm", max_resubmits=max_resubmits))
    return SlurmJobs(site, [spec(tmp_path, 2)])


def end(jobs: SlurmJobs, state: str, code: int | None) -> dict:
    entry = jobs.jobs["decoder"]
    entry["submissions"].append({"job": "7", "state": None})
    entry["job"] = "7"
    jobs._end(entry, JobState("7", state, exit_code=code))
    return entry


def test_a_job_that_ends_otherwise_than_completed_is_resubmitted_with_backoff_up_to_the_limit(tmp_path):
    supervised = jobs(tmp_path)
    for streak, state in enumerate(["CANCELLED", "PREEMPTED"], 1):
        entry = end(supervised, state, 0 if state == "PREEMPTED" else 143)
        assert (entry["state"], entry["streak"]) == ("backoff", streak)
    assert end(supervised, "NODE_FAIL", 1)["state"] == "failed"  # a third in a row: max_resubmits = 2
    assert "max_resubmits" in supervised.jobs["decoder"]["why"]
    assert json.loads((tmp_path / "slurm" / "jobs.json").read_text())["services"][0]["submissions"][0]["state"] == \
        "CANCELLED"  # the ledger holds every submission's end


def test_exit_3_is_never_resubmitted_and_completed_is_done(tmp_path):
    assert end(jobs(tmp_path), "FAILED", 3)["state"] == "failed"
    assert end(jobs(tmp_path / "other"), "COMPLETED", 0)["state"] == "done"


def test_site_status_shows_each_jobs_id_and_state():
    status = {"site": "b", "up": True, "supervisor_pid": 1, "run": "/r", "services": [
        {"service": "gateway", "state": "running"},
        {"service": "decoder", "state": "running", "slurm_job": "42", "slurm_state": "RUNNING"}]}
    lines = format_status(status).splitlines()
    assert lines[1].split()[-2:] == ["slurm_job", "slurm_state"] and lines[3].split()[-2:] == ["42", "RUNNING"]
