"""ELECTRA-Cloud (paper Scenario I) as real processes: a gateway per site, CURVE, loopback, the real
generator and discriminator stages with tiny models on the tiny corpora (copied into tmp_path).

Generators send only ids (deflate) to a discriminator of two data-parallel ranks, paced by a credit of 2;
two generators at two sites teach one discriminator (M3); a generator sending ids outside the vocabulary
stops the discriminator with a DataError that the generator sees as a RemoteError. What the framework does
when a forward-only source or one rank of a stage is killed: test_two_sites.py, on the example workload."""
import math
import os
from pathlib import Path

import pytest

from nebula.errors import StageError
from nebula.runtime.checkpoint import CheckpointDir
from nebula.security.audit import verify
from tests.support.electra import electra_job, expected_ledger, ledger, vocabulary_size
from tests.support.faulty_electra import BAD_STEP
from tests.support.sites import JOB_TIMEOUT, records

REPO = Path(__file__).resolve().parents[2]

RANKS_2 = {'impl = "electra-discriminator"': 'impl = "electra-discriminator"\nranks = 2'}
# and the all-reduce of a larger D's gradient size (Table 4's paper-proportioned D): zeros, never applied
SYNC_NUMEL = 100_000


def step_records(sites, stage: str) -> list[dict]:
    return records(sites.run / stage / "metrics.jsonl", "step")


def assert_each_step_once(sites, sources: dict[str, list[str]]) -> None:
    """Every stage's ledger: each step once, in order, on the examples the example order gives its sources."""
    for stage, fed_by in sources.items():
        assert ledger(sites.run / stage) == expected_ledger(sites.job, fed_by), stage


def test_generator_teaches_a_discriminator_of_two_ranks_over_ids_only(tmp_path, start_job):
    ranks = {k: f"{v}\nsync_numel = {SYNC_NUMEL}" for k, v in RANKS_2.items()}
    sites = start_job(electra_job(tmp_path, ranks))
    sites.wait()
    assert len(sites.group.services["disc"].procs) == 2 and (sites.run / "logs" / "disc.rank1.log").exists()
    last = CheckpointDir(sites.run / "disc" / "checkpoints")
    ballast = last.load(last.steps()[-1])["stage"]["weights"]["sync_ballast"]
    assert ballast.numel() == SYNC_NUMEL and not ballast.any()  # all-reduced every step, never stepped
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
    assert sites.group.services["generator"].proc.returncode == 3  # its peer failed for good: not restarted
    for stage in ("generator", "disc"):
        assert "Traceback" not in sites.log(stage) and "IndexError" not in sites.log(stage)
    assert sites.steps("disc") < BAD_STEP  # nothing of the bad step was applied
