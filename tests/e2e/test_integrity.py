"""What a faulty or hostile peer stage can still do to a two-site job (issue 55), on real sites: gateways and
stages as processes, CURVE, the example workload (tests/e2e/jobs/pair.toml) with the fault-injection
stages of tests/support/poison.py. Each fault stops the job at both sites with its reason, before
anything bad is used or saved, and nothing is restarted into a loop or left waiting.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from nebula.errors import StageError
from nebula.runtime.checkpoint import CheckpointDir, non_finite
from nebula.site.config import load_site_config, write_site_config
from nebula.site.local import local_services
from tests.support.sites import job_file, records

SOURCE = 'impl = "tests.support.runtime:PacedSource"'
NO_COMPRESSION = {'forward = "fp16"\nbackward = "int8"': 'forward = "none"\nbackward = "none"'}


def failed(sites, what: str, timeout: float = 120) -> float:
    """Wait until both stages exited; -> seconds it took. Neither may be restarted (max_restarts=0 makes a
    restart a StageError of the supervisor, which `wait` raises: caught here, then checked)."""
    started = time.monotonic()
    with pytest.raises(StageError):
        sites.wait(timeout=timeout, what=what)
    for name in sites.stages:  # the first to exit stopped supervision; the other follows by itself
        sites.group.services[name].proc.wait(60)
    return time.monotonic() - started


def exits(sites) -> dict[str, int]:
    return {name: sites.group.services[name].proc.returncode for name in sites.stages}


def finite_checkpoints(run: Path, stage: str) -> list[int]:
    """The checkpoint steps of `stage`, after checking every one holds finite values only."""
    checkpoints = CheckpointDir(run / stage / "checkpoints")
    for step in checkpoints.steps():
        assert non_finite(checkpoints.load(step)) == [], (stage, step)
    return checkpoints.steps()


def test_a_nan_activation_is_refused_where_it_arrives_and_no_weight_becomes_nan(tmp_path, start_job):
    """The issue's run: codec `none`, the source's activation NaN at step 5. Before, the NaN crossed both
    gateways, every weight of both stages became NaN and the job ended `done`."""
    job = job_file(tmp_path, "pair", {**NO_COMPRESSION, SOURCE: 'impl = "tests.support.poison:PoisonedSource"\n'
                                                                'poison_steps = [5]'})
    sites = start_job(job, max_restarts=0)
    failed(sites, "both stages to stop at the NaN activation")
    assert exits(sites) == {"src": 3, "sink": 3}  # a fix is needed: neither is restarted
    refused = ("a/src/0 sent step 5 micro-batch 0 on link src->sink: 'hidden' (activation) has 64 NaN/Inf values "
               "of 64: refused")
    assert f"nebula: error: {refused}" in sites.log("sink")
    assert f"b/sink/0 failed: BadTensor: {refused}" in sites.log("src")  # the sender heard why
    audit = records(sites.run / "sink" / "audit.jsonl", None)
    assert [(r["event"], r["step"], r["src"], r["values"]) for r in audit] == [
        ("integrity.refused", 5, "a/src/0", 64)]
    for stage in ("src", "sink"):  # nothing of step 5 was applied, and what is saved is finite
        assert max(finite_checkpoints(sites.run, stage)) == 4
        assert sites.steps(stage) == 4
    losses = [r["loss"] for r in records(sites.run / "sink" / "metrics.jsonl", "step")]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_nan_an_fp16_link_cannot_encode_stops_both_stages_with_the_reason_instead_of_a_hang(tmp_path, start_job):
    """With `fp16` on the link the sender's codec refuses the NaN. That was a failed send, so the source was
    restarted as a crash, resumed, failed the same way, and its peer waited for it (150 s until stopped)."""
    job = job_file(tmp_path, "pair", {SOURCE: 'impl = "tests.support.poison:PoisonedSource"\npoison_steps = [5]'})
    sites = start_job(job, max_restarts=0)
    took = failed(sites, "both stages to stop at the NaN the fp16 codec refuses")
    assert exits(sites) == {"src": 3, "sink": 3}
    cause = "a message could not be built for sending: CodecError: codec 'fp16': tensor has 64 NaN/Inf values"
    assert f"nebula: error: {cause}" in sites.log("src")
    assert f"a/src/0 failed: StageError: {cause}" in sites.log("sink")
    assert took < 60, took  # within the peer timeout (30 s) of the fault, start-up included
    for stage in ("src", "sink"):
        finite_checkpoints(sites.run, stage)


def test_sites_whose_job_files_differ_stop_before_step_1_naming_the_stage_and_the_key(tmp_path, start_job):
    """Site b's copy of the job trains 14 steps, site a's 12: before, both trained until something broke."""
    job = job_file(tmp_path, "pair", {"steps = 12": "steps = 12"})
    sites = start_job(job, max_restarts=0, skip=("sink",))
    other = tmp_path / "job-b.toml"
    other.write_text(job.read_text().replace("steps = 12", "steps = 14"))
    site_b = sites.run / "site-b.toml"
    config = load_site_config(site_b)
    write_site_config(site_b, dataclasses.replace(config, stages=dataclasses.replace(config.stages, job=other)))
    spec, = [s for s in local_services("b", site_b) if s.name == "sink"]
    sites.group.start(spec)
    failed(sites, "both stages to stop on the differing job files")
    assert exits(sites) == {"src": 3, "sink": 3}
    assert "runs another definition of this job (first differing key train.steps: " in sites.log("src") + \
        sites.log("sink")
    assert "stage sink (b/sink/0) runs another definition of this job (first differing key train.steps: 12 here, " \
           "14 there)" in sites.log("src") or "stage src (a/src/0) runs another definition of this job (first " \
           "differing key train.steps: 14 here, 12 there)" in sites.log("sink")
    for stage in ("src", "sink"):
        assert sites.steps(stage) == 0  # refused before step 1


def test_an_exception_in_stage_code_exits_3_with_its_traceback_and_is_not_restarted(tmp_path, start_job):
    """It exited 2, so both sites restarted it five times (~2.5 min)."""
    job = job_file(tmp_path, "pair", {'impl = "tests.support.runtime:PacedSink"':
                                      'impl = "tests.support.poison:BuggySink"'})
    sites = start_job(job, max_restarts=3)
    failed(sites, "the buggy sink to stop its job")
    assert exits(sites) == {"src": 3, "sink": 3}
    assert (sites.restarts("src"), sites.restarts("sink")) == (0, 0)
    log = sites.log("sink")
    assert "Traceback (most recent call last)" in log and "in forward" in log  # where the bug is
    assert ("nebula: error: stage sink failed in its own code: RuntimeError: mat1 and mat2 shapes cannot be "
            "multiplied (8x20 and 16x1) (traceback above in this log)") in log
    assert "b/sink/0 failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in sites.log("src")


def test_a_tensor_of_another_width_is_refused_at_the_first_message_naming_link_port_and_shapes(tmp_path, start_job):
    """The source's code sends (B, 20) where the sink's port declares (B, 16): before, a torch error at step 1."""
    job = job_file(tmp_path, "pair", {SOURCE: 'impl = "tests.support.poison:WideSource"'})
    sites = start_job(job, max_restarts=0)
    failed(sites, "both stages to stop at the wide tensor")
    assert exits(sites) == {"src": 3, "sink": 3}
    cause = ("a/src/0 sent step 1 on link src->sink: 'hidden' has shape (4, 20), but sink declares (B, 16) for its "
             "input port 'hidden'")
    assert f"nebula: error: {cause}" in sites.log("sink")
    assert f"b/sink/0 failed: DataError: {cause}" in sites.log("src")
    assert sites.steps("sink") == 0
