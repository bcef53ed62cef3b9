"""Replicas of a job (cross-site data parallelism) with small real torch stages over in-process channels:
every setting equals its one-process reference (torch's SGD with Nesterov momentum as the outer step), a
replica killed mid-round is left out of that round within the deadline and rejoins by fetching the
others' state (each step applied once), what does not fit is refused and audited, and replicas whose
parameters differ are refused before training."""
import json
import time

import pytest
import torch

from nebula.errors import ConfigError
from nebula.runtime.order import ExampleOrder
from nebula.runtime.replicas import GRAD, HELLO, MEAN, PART, Tag
from nebula.security.audit import verify
from nebula.wire import Kind, Message
from tests.support.replicas import Replicated, reference, replica_job

SLOW = "tests.support.replicas:SlowCrashingSink"

CASES = {"two replicas": dict(), "nesterov off (heavy ball)": dict(replicas={"outer": {"name": "sgd"}}),
         "three replicas of a chain": dict(stages=3, replicas={"groups": [["a", "b", "c"], ["d", "e", "f"],
                                                                          ["g", "h", "i"]], "H": 3}),
         "streaming: 2 fragments, staggered": dict(stages=3, replicas={"fragments": 2}),
         "streaming with overlap": dict(stages=3, replicas={"fragments": 2, "overlap": 1}),
         "count at the same sites": dict(replicas={"groups": [], "count": 3}),
         "H = 1": dict(replicas={"H": 1}, steps=6),
         "sharded: three replicas of a chain": dict(stages=3, replicas={
             "groups": [["a", "b", "c"], ["d", "e", "f"], ["g", "h", "i"]], "H": 3, "exchange": "sharded"}),
         "sharded streaming with overlap": dict(stages=3, replicas={"fragments": 2, "overlap": 1,
                                                                     "exchange": "sharded"})}


def events(root, name, prefix="outer"):
    lines = (root / name / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "event" and e["event"].startswith(prefix)]


def ledger(root, name):
    return [step for step, _ in json.loads((root / name / "ledger.json").read_text())["steps"]]


@pytest.mark.parametrize("case", CASES)
def test_replicas_equal_their_one_process_reference(tmp_path, case):
    job = replica_job(**{"steps": 13, **CASES[case]})
    run = Replicated(job, tmp_path / "run").open().start_all()
    run.join()
    assert not run.errors
    want = reference(job, tmp_path / "ref")
    for name, (_, stage) in job.replicas.instances().items():
        for key, value in want[stage].items():
            torch.testing.assert_close(run.weights(name)[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, key=key: f"{name}.{key}: {m}")
        assert ledger(tmp_path / "run", name) == list(range(1, job.train.steps + 1))
    rounds = events(tmp_path / "run", job.replicas.instance(1, "sink"), "outer")
    assert all(e["contributors"] == list(range(job.replicas.count)) for e in rounds if e["event"] == "outer")


def test_the_reference_depends_on_the_rounds(tmp_path):
    """So the cases above check the rounds: averaged only at the end (H past the job), replicas end elsewhere."""
    synced = reference(replica_job(steps=13), tmp_path / "a")["sink"]["weight"]
    once = reference(replica_job({"H": 100}, steps=13), tmp_path / "b")["sink"]["weight"]
    assert not torch.allclose(synced, once, atol=1e-4)


@pytest.mark.parametrize("codec,atol", [("int8", 2e-3), ("ef(topk(0.5))", 0.05)])
def test_a_compressed_pseudo_gradient_stays_close_to_the_reference(tmp_path, codec, atol):
    job = replica_job({"codec": codec}, steps=12)
    run = Replicated(job, tmp_path / "run").open().start_all()
    run.join()
    want = reference(replica_job(steps=12), tmp_path / "ref")
    for name in ("sink", "sink-r1"):
        torch.testing.assert_close(run.weights(name)["weight"], want["sink"]["weight"], rtol=0, atol=atol)
    sent = [e["sent_bytes"] for e in events(tmp_path / "run", "sink") if e["event"] == "outer"]
    assert sent and all(0 < b < 17 * 4 for b in sent)  # the sink's 17 weights, less than float32


# sharded, whose killed replica also owned a shard, in the default suite; all-to-all is the simpler case
@pytest.mark.parametrize("exchange", [pytest.param("all-to-all", marks=pytest.mark.slow), "sharded"])
def test_a_replica_killed_mid_round_is_left_out_within_the_deadline_and_rejoins(tmp_path, exchange):
    deadline = 2.0
    table = {"deadline_s": deadline, "exchange": exchange}
    job = replica_job(table, steps=24, sink_impl=SLOW)
    crashed = replica_job(table, steps=24, sink_impl=SLOW, sink_options={"crash_at": 6})
    run = Replicated(job, tmp_path / "run").open()
    run.start_all({"sink-r1": crashed})
    run.threads["sink-r1"].join(60)
    assert isinstance(run.errors.pop("sink-r1", None), KeyboardInterrupt), run.errors
    time.sleep(deadline + 1)  # down past a round's deadline: the others go on without it
    run.start("sink-r1", restart=True)
    run.join(120)
    assert not run.errors
    root = tmp_path / "run"
    rounds = [e for e in events(root, "sink") if e["event"] == "outer"]
    left_out = next(e for e in rounds if e["missing"])
    assert left_out["step"] == 8 and left_out["contributors"] == [0] and left_out["wait_s"] < deadline + 1
    assert [e["version"] for e in rounds] == list(range(1, len(rounds) + 1))  # one round per version, in order
    for name in job.instances():
        assert ledger(root, name) == list(range(1, 25)), name  # every step once, at every stage of both
    fetched = events(root, "sink-r1", "outer-fetched")
    assert fetched and fetched[0]["from"] == 0  # it rejoined by taking replica 0's state
    later = [e for e in events(root, "sink-r1") if e["event"] == "outer" and e["step"] > 8]
    assert later and all(e["version"] > fetched[0]["version"] for e in later)
    assert verify(root / "sink" / "audit.jsonl").ok and verify(root / "sink-r1" / "audit.jsonl").ok


def test_what_does_not_fit_is_refused_audited_and_never_averaged(tmp_path):
    job = replica_job(steps=8)
    run = Replicated(job, tmp_path / "run").open()
    sink, peer = job.replicas.addresses[0]["sink"], job.replicas.addresses[1]["sink"]
    chain = "0" * 16

    def grad(delta, replica=1, fragment=0, topic=GRAD, body=None):
        from nebula.codecs import pack
        tag = body if body is not None else json.dumps(
            {"replica": replica, "fragment": fragment, "version": 0, "chain": chain, "weight": 0}).encode()
        return Message(kind=Kind.TENSORS, job="r", src=peer, dst=sink, topic=topic, body=tag,
                       tensors=[pack("delta", "outer", delta, "none")])
    hostile = [grad(torch.tensor([float("nan")] * 17)), grad(torch.zeros(5)), grad(torch.zeros(17), replica=7),
               grad(torch.zeros(17), fragment=4), grad(torch.zeros(17), body=b"{not json"),
               grad(torch.zeros(17), topic="outer-gossip"),
               Message(kind=Kind.CONTROL, job="other", src=peer, dst=sink, topic=HELLO, body=b"{}")]
    for msg in hostile:  # waiting when the sink starts: read during its first round, before the peer's own
        run.hub.deliver(msg)
    run.start_all()
    run.join()
    assert not run.errors
    want = reference(job, tmp_path / "ref")
    torch.testing.assert_close(run.weights("sink")["weight"], want["sink"]["weight"], rtol=1e-5, atol=1e-6)
    refused = [e for e in events(tmp_path / "run", "sink", "outer-refused")]
    reasons = " | ".join(e["reason"] for e in refused)
    assert len(refused) == len(hostile), reasons
    for words in ("non-finite", "shape (5,)", "says it is replica 7", "fragment 4", "not JSON", "outer-gossip",
                  "of job 'other'"):
        assert words in reasons
    records = [json.loads(line) for line in (tmp_path / "run" / "sink" / "audit.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "outer.refused" for r in records) == len(hostile)
    assert verify(tmp_path / "run" / "sink" / "audit.jsonl").ok


def test_a_sharded_round_sends_less_and_refuses_what_does_not_fit(tmp_path):
    """Three replicas: each sends 2 of 3 slices and 2 means of one, not 2 whole vectors (all-to-all); a part
    of a slice that does not exist, of the wrong size, a mean whose contributors leave out its sender and a
    whole pseudo-gradient are refused, audited and never averaged."""
    from nebula.runtime.job import parse_job

    def wide(table):  # 257 weights at the sink, so that the bytes are the vectors' more than the frames'
        raw = replica_job({"groups": [], "count": 3, **table}, steps=8, raw=True)
        raw["stages"]["sink"]["width"] = raw["stages"]["src"]["width"] = 256
        return parse_job(raw)
    sent = {}
    for exchange in ("all-to-all", "sharded"):
        job = wide({"exchange": exchange, "codec": "int8"})
        run = Replicated(job, tmp_path / exchange).open()
        if exchange == "sharded":
            sink, peer = job.replicas.addresses[0]["sink"], job.replicas.addresses[1]["sink"]
            for topic, part, tensor, who in [(PART, 5, torch.zeros(86), ()), (PART, 0, torch.zeros(17), ()),
                                             (MEAN, 1, torch.zeros(86), (0,)), (GRAD, 0, torch.zeros(257), ())]:
                from nebula.codecs import pack
                body = {"replica": 1, "fragment": 0, "version": 0, "chain": "0" * 16, "weight": 0, "part": part,
                        "contributors": list(who)}
                if topic == GRAD:
                    del body["part"], body["contributors"]
                run.hub.deliver(Message(kind=Kind.TENSORS, job="r", src=peer, dst=sink, topic=topic,
                                        body=json.dumps(body).encode(),
                                        tensors=[pack("delta", "outer", tensor, "none")]))
        run.start_all()
        run.join()
        assert not run.errors
        rounds = [e for e in events(tmp_path / exchange, "sink") if e["event"] == "outer"]
        assert rounds and all(e["contributors"] == [0, 1, 2] for e in rounds)
        sent[exchange] = sum(e["sent_bytes"] for e in rounds)
        want = reference(wide({}), tmp_path / f"ref-{exchange}")
        for name in ("sink", "sink-r1", "sink-r2"):
            torch.testing.assert_close(run.weights(name)["weight"], want["sink"]["weight"], rtol=0, atol=4e-3)
    assert sent["sharded"] < 0.75 * sent["all-to-all"], sent  # 2 x 2/3 of a vector against 2 of them
    reasons = " | ".join(e["reason"] for e in events(tmp_path / "sharded", "sink", "outer-refused"))
    for words in ("slice 5 does not exist", "shape (17,), not (86,)", "are not distinct replicas", "a outer-grad in a"):
        assert words in reasons, reasons
    assert verify(tmp_path / "sharded" / "sink" / "audit.jsonl").ok


@pytest.mark.parametrize("what", ["parameters", "rounds"])
def test_replicas_whose_parameters_or_rounds_differ_are_refused_before_training(tmp_path, what):
    from nebula.runtime.job import parse_job
    job = replica_job(steps=8)
    if what == "parameters":
        raw = replica_job(steps=8, raw=True)
        raw["stages"]["sink"]["width"] = raw["stages"]["src"]["width"] = 8
        other, words = parse_job(raw), "has shape"
    else:
        other, words = replica_job({"exchange": "sharded"}, steps=8), "exchange is"
    run = Replicated(job, tmp_path / "run").open()
    run.start_all({"src-r1": other, "sink-r1": other})
    run.join()
    assert set(run.errors) == set(job.instances())  # every stage of both stopped (the first to see it told the rest)
    for replica in (0, 1):
        seen = [str(e) for name, e in run.errors.items() if isinstance(e, ConfigError)
                and job.replicas.instances()[name][0] == replica]
        assert seen and all(f"runs other {what}" in text and words in text for text in seen), run.errors
    for name in job.instances():  # before training: no step was applied anywhere
        assert not (tmp_path / "run" / name / "ledger.json").exists()
        assert {e["step"] for e in events(tmp_path / "run", name, "checkpoint")} <= {0}


def test_each_replica_reads_its_own_shard_every_step_the_global_batch_once():
    n, batch, seed, count = 100, 8, 3, 4
    orders = [ExampleOrder(n, batch, seed, (k, count)) for k in range(count)]
    for k, order in enumerate(orders):
        assert all(i % count == k for t in range(1, 30) for i in order.indices(t))
    step = [i for order in orders for i in order.indices(2)]
    assert len(set(step)) == count * batch  # one global batch of distinct examples (within an epoch)
    again = ExampleOrder(n, batch, seed, (2, count))  # a resumed replica: the same examples, none skipped
    assert [again.indices(t) for t in range(5, 9)] == [orders[2].indices(t) for t in range(5, 9)]
    assert ExampleOrder(n, batch, seed).indices(3) == ExampleOrder(n, batch, seed, (0, 1)).indices(3)


BAD = [({"count": 1}, "count: 1 must be >= 2"),
       ({}, "say how many replicas"),
       ({"count": 3, "groups": [["a", "b"], ["c", "d"]]}, "count = 3 but groups lists 2"),
       ({"groups": [["b", "a"], ["c", "d"]]}, "must be the job's own sites"),
       ({"groups": [["a", "b"], ["c"]]}, "must name 2 different sites"),
       ({"groups": [["a", "b"], ["c", "c"]]}, "must name 2 different sites"),
       ({"groups": [["a", "b"], ["c", "d e"]]}, "site name"),
       ({"groups": [["a", "b"], ["c", "d"]], "H": 10, "fragments": 3}, "multiple of fragments"),
       ({"groups": [["a", "b"], ["c", "d"]], "H": 10, "fragments": 2, "overlap": 5}, "overlap = 5 must be below"),
       ({"groups": [["a", "b"], ["c", "d"]], "codec": "int9"}, "unknown codec"),
       ({"groups": [["a", "b"], ["c", "d"]], "codec": "delta(int8)"}, "activations only"),
       ({"groups": [["a", "b"], ["c", "d"]], "outer": {"lr": 0}}, "must be > 0"),
       ({"groups": [["a", "b"], ["c", "d"]], "outer": {"name": "adam"}}, "is not one of"),
       ({"groups": [["a", "b"], ["c", "d"]], "deadline": 3}, "did you mean 'deadline_s'")]


@pytest.mark.parametrize("table,words", BAD, ids=[w for _, w in BAD])
def test_a_bad_replicas_table_says_how_to_fix_it(table, words):
    raw = replica_job(raw=True)
    raw["replicas"] = table
    from nebula.runtime.job import parse_job
    with pytest.raises(ConfigError, match="replicas") as info:
        parse_job(raw)
    assert words in str(info.value)


def test_a_stale_schedule_cannot_run_replicas():
    from nebula.runtime.job import parse_job
    raw = replica_job(raw=True, schedule="one-step-stale")
    with pytest.raises(ConfigError, match="synchronous"):
        parse_job(raw)


def test_instances_addresses_and_views():
    job = replica_job({"groups": [], "count": 3})
    assert job.replicas.addresses[1] == {"src": "a/src-r1/0", "sink": "b/sink-r1/0"}
    assert list(job.instances()) == ["src", "sink", "src-r1", "sink-r1", "src-r2", "sink-r2"]
    view, stage = job.for_instance("sink-r2")
    assert (stage, view.replica, view.stage("sink").address) == ("sink", 2, "b/sink-r2/0")
    assert view.graph.coordinator == "src"  # each replica has its own: its first stage
    assert job.sites == ["a", "b"]
    assert replica_job().sites == ["a", "b", "d", "e"]
    with pytest.raises(ConfigError, match="no stage or replica instance 'sink-r5'"):
        job.for_instance("sink-r5")
    assert Tag(replica=0, fragment=0, version=0, chain=".", weight=0).replica == 0
