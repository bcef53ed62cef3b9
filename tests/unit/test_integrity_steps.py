"""A bad tensor's step is applied at no stage (issue 55, part B): the example workload's stages in threads on
an in-process channel, the source poisoned (tests/support/poison.py) on 5% of its steps. The target: the
weights finite at both ends, the final loss within 10% of the undisturbed run's, every injection refused
(or withheld) and audited, the job not hung, whatever the codec. The same on real sites with gateways:
tests/e2e/test_integrity.py."""
from __future__ import annotations

import json

import pytest
import torch

from nebula.runtime.outbox import Outbox
from tests.support.runtime import example_job, run_job

STEPS, POISONED = 60, (7, 24, 43)  # 3 of 60 steps: 5%
CODECS = [{"forward": "none", "backward": "none"}, {"forward": "fp16", "backward": "int8"},
          {"forward": "bf16", "backward": "bf16"}, {"forward": "int4(lowrank(0.5))", "backward": "int8(lowrank(0.5))"},
          {"forward": "topk(0.5)", "backward": "ef(topk(0.25))"}, {"forward": "delta(int8)", "backward": "fp16"}]


def _run(tmp_path, name: str, compression: dict, poison: dict | None = None, integrity: dict | None = None):
    options = {"pace_s": 0.0, **({"poison_steps": list(POISONED), **poison} if poison is not None else {})}
    job = example_job(steps=STEPS, compression=compression, source_impl="tests.support.poison:PoisonedSource",
                      source_options=options, integrity=integrity, checkpoint_every=3)
    return run_job(job, tmp_path / name, timeout=90)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _final_loss(root) -> float:
    """The sink's mean loss over the last 10 steps it applied (the last record of a step counts)."""
    losses = {r["step"]: r["loss"] for r in _records(root / "sink" / "metrics.jsonl") if r.get("kind") == "step"}
    return sum(losses[s] for s in sorted(losses)[-10:]) / 10


def _ledger(root, stage: str) -> list[list]:
    return json.loads((root / stage / "ledger.json").read_text())["steps"]


@pytest.mark.parametrize("compression", CODECS, ids=[c["forward"] for c in CODECS])
def test_five_percent_of_steps_poisoned_are_skipped_at_every_stage_whatever_the_codec(tmp_path, compression):
    clean = _run(tmp_path, "clean", compression)
    poisoned = _run(tmp_path, "poisoned", compression, poison={"poison": "nan"})
    for name in ("src", "sink"):
        assert all(torch.isfinite(w).all() for w in poisoned.weights(name).values()), name
        ledger, reference = _ledger(poisoned.root, name), _ledger(clean.root, name)
        assert [s for s, d in ledger if d == "skipped"] == list(POISONED)  # nowhere applied, everywhere skipped
        assert [e for e in ledger if e[1] != "skipped"] == [e for e in reference if e[0] not in POISONED]
    withheld = [r for r in _records(poisoned.root / "src" / "audit.jsonl") if r["event"] == "integrity.withheld"]
    assert [r["step"] for r in withheld] == list(POISONED)  # every injection on the record, once
    assert abs(_final_loss(poisoned.root) - _final_loss(clean.root)) <= 0.1 * _final_loss(clean.root)


def test_a_hostile_peers_bad_tensors_are_refused_where_they_arrive_and_the_peer_is_told(tmp_path, monkeypatch):
    """A peer whose code sends its NaN and Inf unchecked: the sink refuses each at decode, tells the source
    (an ERROR `refused`, which does not stop it) and the step is skipped at both."""
    monkeypatch.setattr(Outbox, "check_outgoing", True)  # the hostile source turns it off in this process
    compression = {"forward": "none", "backward": "none"}
    clean = _run(tmp_path, "clean", compression)
    poisoned = _run(tmp_path, "poisoned", compression, poison={"poison": "inf", "hostile": True})
    # each bad micro-batch that arrived before the resume is refused and on the record (one or more a step)
    audit = _records(poisoned.root / "sink" / "audit.jsonl")
    refused = [r for r in audit if r["event"] == "integrity.refused"]  # in full: 5 per interval, then counted
    assert all((r["src"], r["values"], r["link"]) == ("a/src/0", 64, "src->sink") for r in refused)
    counted = len(refused) + sum(r["suppressed"] for r in audit if r["event"] == "integrity.refused.summary")
    events = [r for r in _records(poisoned.root / "sink" / "metrics.jsonl") if r.get("event") == "integrity.refused"]
    assert sorted({r["step"] for r in events}) == list(POISONED) and counted == len(events)
    told = [r for r in _records(poisoned.root / "src" / "metrics.jsonl") if r.get("event") == "refused-by"]
    assert len(told) == len(events) and all(r["stage"] == "sink" for r in told)
    for name in ("src", "sink"):
        assert all(torch.isfinite(w).all() for w in poisoned.weights(name).values())
        assert [s for s, d in _ledger(poisoned.root, name) if d == "skipped"] == list(POISONED)
    assert abs(_final_loss(poisoned.root) - _final_loss(clean.root)) <= 0.1 * _final_loss(clean.root)


def test_retry_runs_a_step_again_and_skips_it_only_when_it_keeps_failing(tmp_path):
    """on_bad = "retry": a step that is bad once (transient) is applied on its second run, bit for bit as the
    undisturbed run applies it; one that stays bad is skipped after `retries` more tries."""
    compression = {"forward": "none", "backward": "none"}
    clean = _run(tmp_path, "clean", compression)
    retried = _run(tmp_path, "once", compression, poison={"poison_attempts": 1}, integrity={"on_bad": "retry"})
    assert _ledger(retried.root, "sink") == _ledger(clean.root, "sink")  # every step applied, the same examples
    for name in ("src", "sink"):
        assert all(torch.equal(a, b) for a, b in zip(retried.weights(name).values(), clean.weights(name).values()))
    stubborn = _run(tmp_path, "always", compression, poison={}, integrity={"on_bad": "retry", "retries": 2})
    assert [s for s, d in _ledger(stubborn.root, "sink") if d == "skipped"] == list(POISONED)
    aborted = [r for r in _records(stubborn.root / "src" / "metrics.jsonl") if r.get("event") == "aborted"]
    assert [(r["step"], r["outcome"]) for r in aborted] == [(s, o) for s in POISONED
                                                            for o in ("retried", "retried", "skipped")]


def test_on_bad_stop_stops_the_job_with_the_reason(tmp_path):
    job = example_job(steps=12, source_impl="tests.support.poison:PoisonedSource",
                      source_options={"pace_s": 0.0, "poison_steps": [5]}, integrity={"on_bad": "stop"})
    with pytest.raises(AssertionError, match="stages failed"):
        run_job(job, tmp_path / "run", timeout=60)
