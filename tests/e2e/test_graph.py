"""Jobs of more than two stages as real processes (a gateway per site, CURVE, loopback), with the
small stages of services/example: a chain across three sites trains, evaluates through every hop
and survives its middle stage being killed; two forward-only sources at two sites teach one sink
at a third; a stage of two data-parallel ranks (torch.distributed, gloo) ends where one rank does."""
import json
from pathlib import Path

import pytest
import torch

from nebula.security.audit import verify
from tests.support.sites import example_ledger, job_file, records


def weights(run: Path, stage: str, step: int) -> dict:
    return torch.load(run / stage / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)["stage"]["weights"]


def test_three_site_chain_trains_evaluates_and_survives_its_middle_being_killed(tmp_path, start_job):
    sites = start_job(job_file(tmp_path, "chain"))
    sites.wait(until=lambda: sites.steps("mid") >= 5, what="the middle stage to reach step 5")
    reached = sites.steps("mid")
    sites.kill("mid")
    assert reached < sites.job.train.steps, "the job ended before the kill: make it longer"
    sites.wait()
    sites.stop()

    assert sites.restarts("mid") == 1
    for stage in sites.stages:  # every step applied once at every stage, in order
        assert sites.ledger(stage) == example_ledger(sites.job), stage
    resumed = [r["step"] for r in records(sites.run / "src" / "metrics.jsonl") if r.get("event") == "resumed"]
    every = sites.job.train.checkpoint_every
    # a step is recorded before it is checkpointed (runner._apply), so the kill may land between the
    # record of step `reached` and its checkpoint: then the one before it is the last one saved
    assert resumed[0] == 0 and resumed[-1] % every == 0 and resumed[-1] >= (reached - 1) // every * every, \
        f"resumed from {resumed}, killed after step {reached}: expected the checkpoint before the kill"
    losses = [r["loss"] for r in records(sites.run / "sink" / "metrics.jsonl", "step")]
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns
    scores = json.loads((sites.run / "src" / "scores.json").read_text())
    assert scores["sink"]["n"] == 16 and scores["sink"]["mse"] > 0  # inference across both hops
    audit = {site: records(sites.run / "audit" / f"{site}.jsonl") for site in "abc"}
    for site in "abc":
        assert verify(sites.run / "audit" / f"{site}.jsonl").ok
    hops = {(r["src"], r["dst"]) for r in audit["b"] if r["event"] == "transfer.in" and r["kind"] == "TENSORS"}
    assert {("a/src/0", "b/mid/0"), ("c/sink/0", "b/mid/0")} <= hops  # activations in from a, gradients from c
    codecs = {c for r in audit["a"] if r["event"] == "transfer.out" and r["kind"] == "TENSORS" for c in r["codecs"]}
    assert "fp16" in codecs  # the first link's own compression


def test_two_forward_only_sources_at_two_sites_teach_one_sink(tmp_path, start_job):
    sites = start_job(job_file(tmp_path, "merge"))
    sites.wait()
    assert sites.ledger("disc") == example_ledger(sites.job, repeat=2)  # each step: both sources' examples
    assert sites.ledger("es") == sites.ledger("zh") == example_ledger(sites.job)
    for source in ("es", "zh"):  # their own loss trains them; nothing comes back but the pace
        assert all("loss" in r for r in records(sites.run / source / "metrics.jsonl", "step"))
        sent = [r["sent"] for r in records(sites.run / source / "metrics.jsonl", "step")]
        assert set().union(*sent) == {f"{source}->disc:forward"}  # per record: what was encoded since the last


def test_a_stage_of_two_ranks_launched_by_torchrun_ends_where_one_rank_does(tmp_path, start_job):
    """Same job and global batch; the sink as 1 rank, then as 2 gloo ranks that `torchrun --nproc-per-node 2
    -m nebula.cli stage run ...` starts: the variables it sets are all a rank needs. (The supervisor starting
    a stage's ranks itself: test_two_sites.py's killed rank, test_electra.py's discriminator of two ranks.)"""
    import os
    import subprocess
    import sys

    from nebula.site.ports import free_port
    one = start_job(job_file(tmp_path / "one", "chain"))
    one.wait()
    job = job_file(tmp_path / "two", "chain", {'impl = "example-sink"': 'impl = "example-sink"\nranks = 2'})
    two = start_job(job, skip=("sink",))
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "-m", "nebula.cli", "stage", "run", "--job", str(job), "--stage", "sink",
                           "--site", str(two.run / "site-c.toml"), "--workdir", str(two.run / "sink"), "--quiet"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    two.wait(until=lambda: all(two.group.services[n].finished() for n in ("src", "mid")))
    last = one.job.train.steps
    for stage in ("src", "mid", "sink"):
        for key, value in weights(one.run, stage, last).items():
            torch.testing.assert_close(weights(two.run, stage, last)[key], value, rtol=1e-5, atol=1e-6)
        assert two.ledger(stage) == one.ledger(stage) == example_ledger(one.job)
    loss = {run: [r["loss"] for r in records(run / "sink" / "metrics.jsonl", "step")] for run in (one.run, two.run)}
    assert loss[one.run] == pytest.approx(loss[two.run], rel=1e-5)  # reduced over both ranks
