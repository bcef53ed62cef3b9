"""A two-site job as real processes (two gateways, two stages, CURVE, loopback), on the example workload
(tests/e2e/jobs/pair.toml): it completes with every example applied exactly once, evaluates through the
other site and the gateways' audit logs verify and record the cross-site traffic; a stage killed
mid-training (head, tail, under one-step-stale, a forward-only source, one rank of a stage) is restarted
by the supervisor and the job resumes from the last checkpoint every stage holds, without loss or
repeat; a corrupt newest checkpoint falls back to the one before; checkpoints of a one-site run
hot-start the two-site job. The ABNet and ELECTRA jobs themselves: test_abnet.py, test_electra.py."""
import os
import shutil
import signal

import pytest

from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from nebula.security.audit import verify
from tests.support.sites import JOB_TIMEOUT, example_ledger, job_file, records

KILL_AFTER = 5  # steps the victim has applied when it is killed (checkpoints every 2 steps)
# the same job, forward-only (Scenario I's schedule): the source learns from its own loss, the sink paces it
FORWARD_ONLY = {'name = "synchronous"': 'name = "forward-only"\ncredit = 2', "backward = true": "backward = false",
                '\nbackward = "int8"': "", "eval_examples = 16": "local_loss = true"}


def assert_exactly_once(sites) -> None:
    """Every stage applied the scheduled examples of every step, each step once, in order."""
    want = example_ledger(sites.job)
    for name in sites.stages:
        assert sites.ledger(name) == want, f"{name} did not apply each scheduled step once, in order"


def assert_resumed_before(sites, stage: str, reached: int) -> None:
    """`stage` resumed from 0, then from the checkpoint before a kill past step `reached`. A step is
    recorded before it is checkpointed, so the kill may land between the record of step `reached` and
    its checkpoint: then the one before it is the last one saved."""
    resumed, every = sites.resumed(stage), sites.job.train.checkpoint_every
    assert len(resumed) == 2 and resumed[0] == 0 and resumed[1] % every == 0 \
        and resumed[1] >= (reached - 1) // every * every, f"resumed at {resumed} after a kill past step {reached}"


def wait_for_step(sites, stage: str, step: int) -> int:
    sites.wait(until=lambda: sites.steps(stage) >= step, what=f"{stage} to reach step {step}")
    reached = sites.steps(stage)
    assert reached < sites.job.train.steps, "the job ended before the kill: make it longer"
    return reached


def test_job_completes_exactly_once_evaluates_across_sites_and_audits_its_transfers(tmp_path, start_job):
    sites = start_job(job_file(tmp_path, "pair"))
    sites.wait()
    sites.stop()  # the gateways write their final byte counts to the audit log on SIGTERM

    assert_exactly_once(sites)
    assert sites.resumed("src") == sites.resumed("sink") == [0]
    scores = (sites.run / "src" / "scores.json").read_text()
    assert '"n": 16' in scores and '"mse"' in scores  # the test split, scored by the sink at the other site
    sent = sum(r["sent"].get("src->sink:forward", 0) for r in records(sites.run / "src" / "metrics.jsonl", "step"))
    returned = sum(r["sent"].get("src->sink:backward", 0)
                   for r in records(sites.run / "sink" / "metrics.jsonl", "step"))
    assert sent > 0 and returned > 0
    audit = {site: sites.run / "audit" / f"{site}.jsonl" for site in ("a", "b")}
    for site, path in audit.items():
        result = verify(path)
        assert result.ok, f"audit log of site {site}: {result}"
    log_a, log_b = records(audit["a"]), records(audit["b"])
    out_a = [r for r in log_a if r["event"] == "transfer.out" and r["kind"] == "TENSORS"]
    in_b = [r for r in log_b if r["event"] == "transfer.in" and r["kind"] == "TENSORS"]
    assert {(r["src"], r["dst"]) for r in out_a} == {("a/src/0", "b/sink/0")}
    assert {(r["src"], r["dst"]) for r in in_b} == {("a/src/0", "b/sink/0")}
    assert {c for r in out_a for c in r["codecs"]} >= {"fp16"}  # the job's forward codec, as sent
    # every boundary tensor crossed the gateways: what they forwarded covers what the codecs produced
    assert sum(r["bytes"] for r in out_a) >= sent
    assert any(r["event"] == "transfer.out" and r["dst"] == "a/src/0" and "int8" in r["codecs"] for r in log_b)
    stopped = {site: [r for r in log if r["event"] == "gateway.stopped"] for site, log in (("a", log_a), ("b", log_b))}
    assert stopped["a"][-1]["stats"]["links"]["to:b"]["bytes"] >= sent
    assert stopped["b"][-1]["stats"]["links"]["to:a"]["bytes"] >= returned


# one-step-stale's resume is also checked in one process (tests/unit/test_runtime.py, chain-stale-8): slow here
@pytest.mark.parametrize("victim,schedule", [("src", "synchronous"), ("sink", "synchronous"), pytest.param(
    "src", "one-step-stale", marks=pytest.mark.slow)], ids=["head", "tail", "head-stale"])
def test_killed_stage_is_restarted_and_resumes_without_loss_or_repeat(tmp_path, start_job, victim, schedule):
    """one-step-stale: the source runs the next step's forward before each update (weight stashing) and
    is killed with a step in flight."""
    sites = start_job(job_file(tmp_path, "pair", {'name = "synchronous"': f'name = "{schedule}"'}))
    reached = wait_for_step(sites, victim, KILL_AFTER)
    sites.kill(victim)
    sites.wait()

    assert sites.restarts(victim) == 1
    assert_exactly_once(sites)
    assert_resumed_before(sites, "src", reached)
    assert '"n": 16' in (sites.run / "src" / "scores.json").read_text()


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, start_job):
    sites = start_job(job_file(tmp_path, "pair"))
    wait_for_step(sites, "sink", KILL_AFTER)
    sites.kill("sink")  # supervision is paused while the test holds it: nothing restarts yet
    ckpt = sites.run / "sink" / "checkpoints"
    newest = max(p for p in ckpt.glob("step-*.pt") if p.with_name(f"{p.name}.sha256").exists())
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the tensors
    newest.write_bytes(bytes(data))
    corrupt_step = int(newest.stem.split("-")[1])
    sites.wait()

    assert_exactly_once(sites)
    resumed = sites.resumed("src")
    assert len(resumed) == 2 and resumed[-1] < corrupt_step, f"resumed from {resumed} although {newest.name} is corrupt"
    warnings = [r["message"] for r in records(sites.run / "sink" / "metrics.jsonl") if r.get("event") == "warning"]
    assert any(str(newest) in w and "corrupt" in w for w in warnings), warnings
    assert f"checkpoint {newest} is corrupt" in sites.log("sink")


def test_one_site_checkpoints_hot_start_the_two_site_job(tmp_path, start_job):
    """Paper §4.3, what `nebula demo --hot-start` does: train the first half on one site, then both sites
    continue from its checkpoints."""
    path = job_file(tmp_path, "pair")
    job = load_job(path)
    half = job.train.steps // 2
    run_one_site(job, tmp_path / "one-site", quiet=True, timeout=JOB_TIMEOUT, until=half)
    for name in job.stages:
        shutil.copytree(tmp_path / "one-site" / name / "checkpoints", tmp_path / "run0" / name / "checkpoints")

    sites = start_job(path)
    sites.wait()

    assert sites.resumed("src") == [half]  # continued where the single site stopped
    trained = records(sites.run / "src" / "metrics.jsonl", "step")
    assert [r["step"] for r in trained] == list(range(half + 1, job.train.steps + 1))
    assert_exactly_once(sites)  # one site then two: every scheduled step applied once, in order


def test_killed_forward_only_source_is_awaited_restarted_and_nothing_is_lost_or_repeated(tmp_path, start_job):
    """The sink only waits for its source (the waiting notice it gives meanwhile: tests/unit/test_runtime.py,
    test_a_stage_that_receives_nothing_says_whom_it_waits_for_and_goes_on_waiting)."""
    sites = start_job(job_file(tmp_path, "pair", FORWARD_ONLY))
    reached = wait_for_step(sites, "sink", 3)
    sites.kill("src")
    sites.wait()  # the supervisor restarts the source

    assert (sites.restarts("src"), sites.restarts("sink")) == (1, 0)  # the sink only waited
    assert_exactly_once(sites)
    assert_resumed_before(sites, "sink", reached)
    assert sites.resumed("src") == sites.resumed("sink")


def test_killed_rank_stops_its_stage_which_restarts_and_resumes(tmp_path, start_job):
    """Rank 1 of the sink SIGKILLed: rank 0 stops by itself (a rank gone is restarted, not blamed on
    anyone), the supervisor restarts both ranks, and every stage resumes from the last checkpoint they
    all hold; the source is neither told to stop nor restarted."""
    sites = start_job(job_file(tmp_path, "pair", {**FORWARD_ONLY, "pace_s = 0.025\n\n[[links]]":
                                                  "pace_s = 0.025\nranks = 2\n\n[[links]]"}))
    reached = wait_for_step(sites, "sink", 3)
    root, sub = sites.group.services["sink"].procs
    os.killpg(sub.pid, signal.SIGKILL)
    sub.wait(10)
    root.wait(60)  # supervision is paused while the test holds it: nothing restarts yet
    assert root.returncode == 2, sites.log("sink")  # a failure a restart cures, not one to fix first
    assert "nebula: error: stage sink rank 0/2: another rank of the stage is gone (" in sites.log("sink")
    assert sites.group.services["src"].proc.poll() is None  # not blamed
    sites.wait()

    assert (sites.restarts("sink"), sites.restarts("src")) == (1, 0)
    assert "remote error" not in sites.log("src")
    assert_exactly_once(sites)
    assert_resumed_before(sites, "src", reached)
    assert sites.resumed("sink") == sites.resumed("src")  # rank 0 of the restarted stage, at the same checkpoint
