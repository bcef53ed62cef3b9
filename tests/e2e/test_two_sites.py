"""ABNet-Cloud es->en across two sites as real processes (two gateways, two stages, CURVE, loopback):
the job completes with every example applied exactly once, even when a stage is killed mid-training
or its newest checkpoint is corrupt, scores come back across the sites, and the gateways' audit logs
verify and record the cross-site traffic."""
import json

import pytest

from nebula.security.audit import verify
from tests.support.sites import expected_ledger, records, write_job

KILL_AFTER = 5  # steps the victim has applied when it is killed (checkpoints every 2 steps)


def ledgers(sites) -> dict[str, list]:
    return {name: json.loads((sites.run / name / "ledger.json").read_text())["steps"] for name in sites.stages}


def assert_exactly_once(sites) -> None:
    """Both stages applied the scheduled examples of every step, each step once, in order."""
    want = expected_ledger(sites.job)
    got = ledgers(sites)
    for name, ledger in got.items():
        steps = [s for s, _ in ledger]
        assert steps == list(range(1, sites.job.train.steps + 1)), f"{name} applied steps {steps}"
        assert ledger == want, f"{name} trained on other examples than the schedule says"
    assert got["encoder"] == got["decoder"]


def resumed_steps(sites) -> list[int]:
    """Checkpoint steps the head resumed from after a restart (the first agreement is at step 0)."""
    events = [r for r in records(sites.run / "encoder" / "metrics.jsonl") if r.get("event") == "resumed"]
    return [r["step"] for r in events[1:]]


def test_job_completes_with_scores_ledgers_and_audited_transfers(tmp_path, start_job):
    sites = start_job(write_job(tmp_path))
    sites.wait()
    sites.stop()  # the gateways write their final byte counts to the audit log on SIGTERM

    assert_exactly_once(sites)
    assert resumed_steps(sites) == []
    scores = json.loads((sites.run / "encoder" / "scores.json").read_text())
    assert scores["split"] == "test" and scores["n"] == 16
    assert isinstance(scores["bleu"], float) and 0.0 <= scores["bleu"] <= 100.0
    hyps = (sites.run / "decoder" / "test.hyp").read_text().splitlines()  # kept at site b, with the refs
    refs = (sites.run / "decoder" / "test.ref").read_text().splitlines()
    assert len(hyps) == len(refs) == 16 and scores["samples"][0] == hyps[0]  # references stay at b
    assert not (sites.run / "encoder" / "test.ref").exists()

    sent = sum(r["sent"].get("encoder->decoder:forward", 0) for r in records(sites.run / "encoder" / "metrics.jsonl", "step"))
    returned = sum(r["sent"].get("encoder->decoder:backward", 0)
                   for r in records(sites.run / "decoder" / "metrics.jsonl", "step"))
    assert sent > 0 and returned > 0
    audit = {site: sites.run / "audit" / f"{site}.jsonl" for site in ("a", "b")}
    for site, path in audit.items():
        result = verify(path)
        assert result.ok, f"audit log of site {site}: {result}"
    log_a, log_b = records(audit["a"]), records(audit["b"])
    out_a = [r for r in log_a if r["event"] == "transfer.out" and r["kind"] == "TENSORS"]
    in_b = [r for r in log_b if r["event"] == "transfer.in" and r["kind"] == "TENSORS"]
    assert {(r["src"], r["dst"]) for r in out_a} == {("a/encoder/0", "b/decoder/0")}
    assert {(r["src"], r["dst"]) for r in in_b} == {("a/encoder/0", "b/decoder/0")}
    assert {c for r in out_a for c in r["codecs"]} >= {"fp16"}  # the job's forward codec, as sent
    # every boundary tensor crossed the gateways: what they forwarded covers what the codecs produced
    assert sum(r["bytes"] for r in out_a) >= sent
    assert any(r["event"] == "transfer.out" and r["dst"] == "a/encoder/0" and "int8" in r["codecs"] for r in log_b)
    stopped = {site: [r for r in log if r["event"] == "gateway.stopped"]
               for site, log in (("a", log_a), ("b", log_b))}
    assert stopped["a"][-1]["stats"]["links"]["to:b"]["bytes"] >= sent
    assert stopped["b"][-1]["stats"]["links"]["to:a"]["bytes"] >= returned


@pytest.mark.parametrize("victim,schedule", [("encoder", "synchronous"), ("decoder", "synchronous"),
                                             ("encoder", "one-step-stale")], ids=["encoder", "decoder", "encoder-stale"])
def test_killed_stage_is_restarted_and_resumes_without_loss_or_repeat(tmp_path, start_job, victim, schedule):
    """one-step-stale: the encoder runs the next step's forward before each update (weight stashing on
    the real adapters) and is killed with a step in flight."""
    sites = start_job(write_job(tmp_path, {'name = "synchronous"': f'name = "{schedule}"'}))
    sites.wait(until=lambda: sites.steps(victim) >= KILL_AFTER, what=f"{victim} to reach step {KILL_AFTER}")
    assert sites.steps(victim) < sites.job.train.steps, "the job ended before the kill: make it longer"
    sites.kill(victim)
    sites.wait()

    assert sites.restarts(victim) == 1
    assert_exactly_once(sites)
    resumed = resumed_steps(sites)
    every = sites.job.train.checkpoint_every
    assert resumed and resumed[-1] >= KILL_AFTER // every * every, \
        f"resumed from {resumed}: expected the checkpoint before the kill, not an older one"
    assert json.loads((sites.run / "encoder" / "scores.json").read_text())["n"] == 16


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, start_job):
    # ABNet's own objective here (CMLM, mask-predict scoring), so both decoders run end to end.
    sites = start_job(write_job(tmp_path, {'objective = "ar"': 'objective = "cmlm"'}))
    sites.wait(until=lambda: sites.steps("decoder") >= KILL_AFTER, what=f"decoder to reach step {KILL_AFTER}")
    sites.kill("decoder")  # supervision is paused while the test holds it: nothing restarts yet
    ckpt = sites.run / "decoder" / "checkpoints"
    newest = max(p for p in ckpt.glob("step-*.pt") if p.with_name(f"{p.name}.sha256").exists())
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the tensors
    newest.write_bytes(bytes(data))
    corrupt_step = int(newest.stem.split("-")[1])
    sites.wait()

    assert_exactly_once(sites)
    resumed = resumed_steps(sites)
    assert resumed and resumed[-1] < corrupt_step, f"resumed from {resumed} although {newest.name} is corrupt"
    warnings = [r["message"] for r in records(sites.run / "decoder" / "metrics.jsonl") if r.get("event") == "warning"]
    assert any(str(newest) in w and "corrupt" in w for w in warnings), warnings
    assert f"checkpoint {newest} is corrupt" in sites.log("decoder")
