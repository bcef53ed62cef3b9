"""ELECTRA-Cloud (paper Scenario I) as real processes: a gateway per site, CURVE, loopback, the real
generator and discriminator stages with tiny models on the tiny corpora (copied into tmp_path).

Generators send only ids (deflate) to a discriminator of two data-parallel ranks, paced by a credit of 2;
two generators at two sites teach one discriminator (M3); a generator killed mid-run, or one rank of the
discriminator, is restarted by the supervisor and the job resumes from the last checkpoint every stage
holds, with every step applied exactly once at every stage; a generator sending ids outside the
vocabulary stops the discriminator with a DataError that the generator sees as a RemoteError."""
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest

from nebula.errors import StageError
from nebula.security.audit import verify
from tests.support.sites import JOB_TIMEOUT, records
from tests.support.faulty_electra import BAD_STEP
from tests.support.electra import electra_job, expected_ledger, ledger, vocabulary_size

REPO = Path(__file__).resolve().parents[2]

RANKS_2 = {'impl = "electra-discriminator"': 'impl = "electra-discriminator"\nranks = 2'}


def step_records(sites, stage: str) -> list[dict]:
    return records(sites.run / stage / "metrics.jsonl", "step")


def resumed_at(sites, stage: str) -> list[int]:
    return [r["step"] for r in records(sites.run / stage / "metrics.jsonl") if r.get("event") == "resumed"]


def assert_each_step_once(sites, sources: dict[str, list[str]]) -> None:
    """Every stage's ledger: each step once, in order, on the examples the example order gives its sources."""
    for stage, fed_by in sources.items():
        assert ledger(sites.run / stage) == expected_ledger(sites.job, fed_by), stage


def wait_unsupervised(until, what: str, sites, timeout: float = 90.0) -> None:
    """Wait for `until()` without restarting anything (Sites.wait would restart a killed stage at once)."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{sites.tails()}")
        time.sleep(0.1)


def test_generator_teaches_a_discriminator_of_two_ranks_over_ids_only(tmp_path, start_job):
    sites = start_job(electra_job(tmp_path, RANKS_2))
    sites.wait()
    assert len(sites.group.services["disc"].procs) == 2 and (sites.run / "logs" / "disc.rank1.log").exists()
    assert_each_step_once(sites, {"generator": ["generator"], "disc": ["generator"]})
    assert ledger(sites.run / "disc") == ledger(sites.run / "generator")  # the same examples, step by step
    steps = sites.job.train.steps
    generator, disc = step_records(sites, "generator"), step_records(sites, "disc")
    assert [r["step"] for r in generator] == [r["step"] for r in disc] == list(range(1, steps + 1))
    for r in generator:  # index-only: about 2 payload bytes per token with deflate (more on messages this small)
        assert 0 < r["bytes_per_token"]["generator->disc:forward"] < 3
        assert r["stats"]["sequences"] == sites.job.train.batch_size
    assert all(math.isfinite(r["loss"]) for r in generator + disc)
    audit = {site: records(sites.run / "audit" / f"{site}.jsonl") for site in "ab"}
    assert all(verify(sites.run / "audit" / f"{site}.jsonl").ok for site in "ab")
    out = [r for r in audit["a"] if r["event"] == "transfer.out" and r["kind"] == "TENSORS"]
    assert out and {c for r in out for c in r["codecs"]} == {"deflate"}  # ids, deflated, through the gateway
    assert not [r for r in audit["a"] if r["event"] == "transfer.in" and r["kind"] == "TENSORS"]  # no gradient back


def test_two_generators_at_two_sites_teach_one_discriminator(tmp_path, start_job):
    """M3: the Spanish group's generator at a, the Chinese group's at c, the discriminator at b."""
    sites = start_job(electra_job(tmp_path, name="electra-m3"))
    sites.wait()
    assert_each_step_once(sites, {"gen-es": ["gen-es"], "gen-zh": ["gen-zh"], "disc": ["gen-es", "gen-zh"]})
    assert all(a != b for (_, a), (_, b) in zip(ledger(sites.run / "gen-es"), ledger(sites.run / "gen-zh")))
    for generator in ("gen-es", "gen-zh"):
        sent = {k for r in step_records(sites, generator) for k in r["sent"]}
        assert sent == {f"{generator}->disc:forward"}
    hops = {(r["src"], r["dst"]) for r in records(sites.run / "audit" / "b.jsonl")
            if r["event"] == "transfer.in" and r["kind"] == "TENSORS"}
    assert hops == {("a/gen-es/0", "b/disc/0"), ("c/gen-zh/0", "b/disc/0")}


def test_killed_generator_is_awaited_restarted_and_nothing_is_lost_or_repeated(tmp_path, start_job):
    # a restart on these 2 busy cores can take longer than the default peer_timeout (30 s) after which the
    # discriminator would give up on the generator (and be restarted too): here it must only wait
    sites = start_job(electra_job(tmp_path, {"steps = 8": "steps = 12"}), channel={"peer_timeout": 120.0})
    sites.wait(until=lambda: sites.steps("disc") >= 3, what="the discriminator to reach step 3")
    reached = sites.steps("disc")
    sites.kill("generator")
    assert reached < sites.job.train.steps, "the job ended before the kill: make it longer"
    # the generator stays down (no supervision) until the discriminator says whom it waits for
    line = re.compile(r"^\[disc\] waiting for generator \(a/generator/0\) since (\d+) s$", re.M)
    wait_unsupervised(lambda: line.search(sites.log("disc")), "the discriminator's waiting line", sites)
    assert int(line.search(sites.log("disc"))[1]) >= 10  # said after 10 s of silence, not before
    sites.wait()  # the supervisor restarts the generator
    assert (sites.restarts("generator"), sites.restarts("disc")) == (1, 0)  # the discriminator only waited
    waiting = [r for r in records(sites.run / "disc" / "metrics.jsonl") if r.get("event") == "waiting"]
    assert waiting[0]["stages"] == ["generator"] and waiting[0]["since_s"] >= 10
    assert_each_step_once(sites, {"generator": ["generator"], "disc": ["generator"]})
    resumed, every = resumed_at(sites, "disc"), sites.job.train.checkpoint_every
    assert len(resumed) == 2 and resumed[0] == 0 and resumed[1] % every == 0 \
        and resumed[1] >= (reached - 1) // every * every, f"resumed at {resumed} after a kill past step {reached}"
    assert resumed_at(sites, "generator") == resumed


def test_killed_sub_discriminator_stops_its_stage_which_restarts_and_resumes(tmp_path, start_job):
    """Rank 1 of the discriminator SIGKILLed: rank 0 stops by itself (a rank gone is restarted, not
    blamed on anyone), the supervisor restarts both ranks, and every stage resumes from the last
    checkpoint they all hold; the generator is neither told to stop nor restarted."""
    sites = start_job(electra_job(tmp_path, {**RANKS_2, "steps = 8": "steps = 12"}))
    sites.wait(until=lambda: sites.steps("disc") >= 3, what="the discriminator to reach step 3")
    reached = sites.steps("disc")
    root, sub = sites.group.services["disc"].procs
    os.killpg(sub.pid, signal.SIGKILL)
    sub.wait(10)
    assert reached < sites.job.train.steps, "the job ended before the kill: make it longer"
    wait_unsupervised(lambda: root.poll() is not None, "rank 0 of the discriminator to stop", sites)
    assert root.returncode == 2, sites.log("disc")  # a failure a restart cures, not one to fix first
    assert "nebula: error: stage disc rank 0/2: another rank of the stage is gone (" in sites.log("disc")
    assert sites.group.services["generator"].proc.poll() is None  # not blamed
    sites.wait()
    assert (sites.restarts("disc"), sites.restarts("generator")) == (1, 0)
    assert "remote error" not in sites.log("generator")
    assert_each_step_once(sites, {"generator": ["generator"], "disc": ["generator"]})
    resumed, every = resumed_at(sites, "generator"), sites.job.train.checkpoint_every
    assert len(resumed) == 2 and resumed[0] == 0 and resumed[1] % every == 0 \
        and resumed[1] >= (reached - 1) // every * every, f"resumed at {resumed} after a kill past step {reached}"
    assert resumed_at(sites, "disc") == resumed  # rank 0 of the restarted stage, at the same checkpoint


def test_ids_outside_the_vocabulary_stop_the_discriminator_naming_the_vocabulary(tmp_path, start_job,
                                                                                  monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    job = electra_job(tmp_path, {'impl = "electra-generator"':
                                 'impl = "tests.support.faulty_electra:OutOfVocabularyGenerator"'})
    sites = start_job(job, max_restarts=0)
    with pytest.raises(StageError):
        sites.wait(timeout=JOB_TIMEOUT, what="the stages to fail on the id outside the vocabulary")
    for name in sites.stages:  # the first to exit stopped supervision; the other follows by itself
        sites.group.services[name].proc.wait(30)
    vocab = vocabulary_size(sites.job, "disc")
    cause = (f"step {BAD_STEP} micro-batch 0 on generator->disc: 1 tokens outside the vocabulary of {vocab} ids "
             f"(e.g. {vocab + 5}): every stage must use the same vocabulary (vocab_corpora)")
    assert f"nebula: error: {cause}" in sites.log("disc")
    assert sites.group.services["disc"].proc.returncode == 3  # bad data: not restarted
    assert "remote error [stage]: b/disc/0 failed: DataError: " + cause in sites.log("generator")
    assert sites.group.services["generator"].proc.returncode == 2
    for stage in ("generator", "disc"):
        assert "Traceback" not in sites.log(stage) and "IndexError" not in sites.log(stage)
    assert sites.steps("disc") < BAD_STEP  # nothing of the bad step was applied
