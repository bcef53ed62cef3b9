"""Replicas as real processes (tests/e2e/jobs/replicas.toml: the example pair at sites a, b and its replica at
c, d; four gateways, CURVE, loopback): every round averages both replicas' int8 pseudo-gradients through
the gateways (all-to-all, or sharded: halves and their means), which audit each one, and the replicas end
with the same weights; a replica's stage killed mid-round is left out of that round within the deadline,
its supervisor restarts it, it rejoins by fetching the other replica's state, and every stage of both
replicas applies each of its steps once."""
import pytest
import torch

from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.order import ExampleOrder, digest, id_hash
from nebula.security.audit import verify
from tests.support.sites import job_file, records


def shard_ledger(job, k: int) -> list[list]:
    """What each step of replica k must have trained on: its shard of the example order."""
    n = job.stage("src").options.examples
    hashes = [id_hash(f"train:{i}") for i in range(n)]
    order = ExampleOrder(n, job.train.batch_size, job.train.seed, (k, job.replicas.count))
    return [[s, digest([hashes[i] for i in order.indices(s)])] for s in range(1, job.train.steps + 1)]


def rounds(sites, name: str) -> list[dict]:
    return [r for r in records(sites.run / name / "metrics.jsonl") if r.get("event") == "outer"]


def final_weights(sites, name: str) -> dict:
    saved = CheckpointDir(sites.run / name / "checkpoints")
    return saved.load(max(saved.steps()))["stage"]["weights"]


@pytest.mark.parametrize("exchange", ["all-to-all", pytest.param("sharded", marks=pytest.mark.slow)])
def test_replicas_average_through_the_gateways_and_end_alike(tmp_path, start_job, exchange):
    sites = start_job(job_file(tmp_path, "replicas", {'codec = "int8"': f'codec = "int8"\nexchange = "{exchange}"'}))
    sites.wait()
    sites.stop()
    job = sites.job
    for name, (k, _) in job.replicas.instances().items():
        assert sites.ledger(name) == shard_ledger(job, k), f"{name}: not its shard's steps, each once"
        assert [(r["step"], r["contributors"]) for r in rounds(sites, name)] == [(s, [0, 1]) for s in (4, 8, 12, 16)]
        assert verify(sites.run / name / "audit.jsonl").ok
    for stage in ("src", "sink"):
        ours, theirs = final_weights(sites, stage), final_weights(sites, f"{stage}-r1")
        for key, value in ours.items():
            torch.testing.assert_close(theirs[key], value, rtol=0, atol=0)
    for site in ("a", "d"):  # every pseudo-gradient crossed the WAN through both gateways, recorded at each
        audit = sites.run / "audit" / f"{site}.jsonl"
        assert verify(audit).ok
        grads = [r for r in records(audit)
                 if r.get("event", "").startswith("transfer.") and "int8" in r.get("codecs", ())]
        assert len(grads) >= 4, f"gateway {site} recorded {len(grads)} int8 transfers"


@pytest.mark.slow
def test_a_replica_killed_mid_round_is_left_out_and_rejoins_exactly_once(tmp_path, start_job):
    deadline = 3
    # long enough that replica 0 still trains when replica 1's stage is back (a restart takes seconds here)
    slower = {"deadline_s = 30": f"deadline_s = {deadline}", "steps = 16": "steps = 60",
              "pace_s = 0.025": "pace_s = 0.1"}
    sites = start_job(job_file(tmp_path, "replicas", slower))
    sites.wait(until=lambda: sites.steps("sink-r1") >= 5, what="sink-r1 to reach step 5")
    assert sites.steps("sink-r1") < 8, "the kill must land inside the round that ends at step 8"
    sites.kill("sink-r1")
    sites.wait()
    sites.stop()
    job = sites.job
    left_out = [r for r in rounds(sites, "sink") if r["missing"]]
    assert left_out and left_out[0]["step"] == 8 and left_out[0]["contributors"] == [0], rounds(sites, "sink")
    assert left_out[0]["wait_s"] <= deadline + 1  # the others finished that round within the deadline
    assert [r["version"] for r in rounds(sites, "sink")] == list(range(1, len(rounds(sites, "sink")) + 1))
    for name, (k, _) in job.replicas.instances().items():
        assert sites.ledger(name) == shard_ledger(job, k), f"{name}: not each of its steps once"
    assert sites.restarts("sink-r1") == 1 and sites.resumed("sink-r1")[-1] > 0
    fetched = [r for r in records(sites.run / "sink-r1" / "metrics.jsonl") if r.get("event") == "outer-fetched"]
    assert fetched and fetched[0]["from"] == 0  # it rejoined with replica 0's state
    after = rounds(sites, "sink")[left_out[0]["version"]:]
    assert any(r["contributors"] == [0, 1] for r in after)  # and the two average again


@pytest.mark.slow
def test_a_replicas_stage_of_two_ranks_ends_where_one_rank_does(tmp_path, start_job):
    """Each replica's sink as 2 gloo ranks: rank 0 runs the rounds and hands the weights they write to rank 1,
    so every instance ends where it ends with one rank (the same shards and global batch)."""
    one = start_job(job_file(tmp_path / "one", "replicas"))
    one.wait()
    two = start_job(job_file(tmp_path / "two", "replicas", {'pace_s = 0.025\n\n[[links]]': 'pace_s = 0.025\nranks = 2'
                                                                                             '\n\n[[links]]'}))
    two.wait()
    assert len(two.group.services["sink-r1"].procs) == 2
    for name in one.job.instances():
        for key, value in final_weights(one, name).items():
            torch.testing.assert_close(final_weights(two, name)[key], value, rtol=1e-5, atol=1e-6)
        assert two.ledger(name) == one.ledger(name)


@pytest.mark.slow  # eight processes (four stages, four gateways), two of transformers models each site: ~2 min
@pytest.mark.timeout(900)
def test_a_brought_model_split_across_two_sites_is_replicated_at_two_more(tmp_path, start_job):
    """transformers' GPT-2 cut in two by the split workload (no stage code: docs/model.md), its pipeline at
    sites a, b and a replica at c, d, sharded int8 rounds every 4 steps: each part's instances end alike."""
    from nebula.runtime.job_file import read_job_table, write_job_file
    from services.split.bench import portable
    from tests.support.split import gpt2_job

    path = gpt2_job(tmp_path / "src", ["transformer.h.2"], steps=8)
    table = portable(read_job_table(path), path)
    table["replicas"] = {"groups": [["a", "b"], ["c", "d"]], "H": 4, "codec": "int8", "exchange": "sharded",
                         "deadline_s": 120}
    write_job_file(tmp_path / "job.toml", table)
    sites = start_job(tmp_path / "job.toml")
    sites.wait(timeout=600)
    sites.stop()
    for name in sites.job.replicas.instances():
        assert [(r["step"], r["contributors"]) for r in rounds(sites, name)] == [(4, [0, 1]), (8, [0, 1])], name
        assert sites.ledger(name) and [s for s, _ in sites.ledger(name)] == list(range(1, 9)), name
    for part in ("p0", "p1"):
        ours, theirs = final_weights(sites, part), final_weights(sites, f"{part}-r1")
        for key, value in ours.items():
            torch.testing.assert_close(theirs[key], value, rtol=0, atol=0)
