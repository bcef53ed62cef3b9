"""What a stage takes from its links and what it saves (issue 55, point 1): nebula/runtime/integrity.py's
checks with a real audit log and metrics log, and nebula/runtime/checkpoint.py's refusal of non-finite
state. The same checks on a job of real stages and gateways: tests/e2e/test_integrity.py."""
from __future__ import annotations

import json
import math

import pytest
import torch

from nebula.errors import ConfigError, StageError
from nebula.runtime.checkpoint import CheckpointDir, non_finite
from nebula.runtime.integrity import BadTensor, Integrity, IntegrityConfig, inspect_norm
from nebula.runtime.metrics import MetricsLog
from nebula.security.audit import AuditLog, verify

WHERE = {"link": "src->sink", "direction": "forward", "name": "hidden", "src": "a/src/0", "micro_batch": 0}


def _integrity(tmp_path, **config) -> Integrity:
    metrics = MetricsLog(tmp_path / "metrics.jsonl", "sink", quiet=True)
    return Integrity(IntegrityConfig(**config), metrics, AuditLog(tmp_path / "audit.jsonl"), report_every=5)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_pass_gives_the_norm_and_a_second_counts_the_bad_values_only_when_there_are_some():
    x = torch.randn(64, 16)
    assert inspect_norm(x) == (pytest.approx(float(x.norm())), 0)
    x[3, 4], x[7, 1] = float("nan"), float("-inf")
    norm, bad = inspect_norm(x)
    assert not math.isfinite(norm) and bad == 2
    huge = torch.full((4,), 1e30)  # every value finite, their squares are not
    assert inspect_norm(huge) == (math.inf, 0)


def test_a_non_finite_tensor_is_refused_recorded_and_counted_nothing_of_it_enters_the_statistics(tmp_path):
    integrity = _integrity(tmp_path)
    for step in range(1, 4):
        integrity.inspect(torch.ones(8, 4), step=step, **WHERE)
    poisoned = torch.ones(8, 4)
    poisoned[0] = float("nan")
    with pytest.raises(BadTensor, match=r"a/src/0 sent step 4 micro-batch 0 on link src->sink: 'hidden' "
                                        r"\(activation\) has 4 NaN/Inf values of 32: refused") as refused:
        integrity.inspect(poisoned, step=4, **WHERE)
    assert refused.value.reason == "non-finite"
    stats = integrity.summary()["src->sink:forward/hidden"]
    assert stats["seen"] == 3 and stats["refused"] == 1 and stats["median"] == pytest.approx(math.sqrt(32))
    integrity.close()
    audit = _records(tmp_path / "audit.jsonl")
    assert [(r["event"], r["step"], r["values"]) for r in audit] == [("integrity.refused", 4, 4)]
    assert verify(tmp_path / "audit.jsonl").ok  # hash-chained like every audit log
    events = [r for r in _records(tmp_path / "metrics.jsonl") if r.get("event") == "integrity.refused"]
    assert events[0]["src"] == "a/src/0" and events[0]["values"] == 4


def test_norms_far_from_the_running_median_are_warned_about_and_past_refuse_factor_refused(tmp_path):
    integrity = _integrity(tmp_path, warmup=4, warn_factor=10.0, refuse_factor=1000.0)
    for step in range(1, 6):
        integrity.inspect(torch.full((10,), 1.0 + step / 100), step=step, **WHERE)  # norms ~3.2
    integrity.inspect(torch.full((10,), 100.0), step=6, **WHERE)  # ~100x the median: warned, still used
    integrity.inspect(torch.full((10,), 1e-3), step=7, **WHERE)  # 1/1000: warned too
    with pytest.raises(BadTensor, match="times its link's running median") as refused:
        integrity.inspect(torch.full((10,), 1e4), step=8, **WHERE)  # 10^4 x: refused
    assert refused.value.reason == "outlier"
    stats = integrity.summary()["src->sink:forward/hidden"]
    assert (stats["seen"], stats["warned"], stats["refused"]) == (7, 2, 1)
    integrity.close()
    audit = _records(tmp_path / "audit.jsonl")
    assert [(r["event"], r["step"]) for r in audit] == [("integrity.outlier", 6), ("integrity.outlier", 7),
                                                         ("integrity.refused", 8)]
    assert audit[0]["ratio"] > 10 and audit[1]["ratio"] < 0.1
    reports = [r for r in _records(tmp_path / "metrics.jsonl") if r.get("event") == "integrity"]
    assert reports and "src->sink:forward/hidden" in reports[-1]["norms"]  # the statistics, in metrics


def test_a_peer_that_sends_bad_tensors_in_a_loop_costs_a_few_audit_records_each_counted(tmp_path):
    integrity = _integrity(tmp_path)
    bad = torch.full((4,), float("inf"))
    for step in range(1, 101):
        with pytest.raises(BadTensor):
            integrity.inspect(bad, step=step, **WHERE)
    integrity.close()
    audit = _records(tmp_path / "audit.jsonl")
    full = [r for r in audit if r["event"] == "integrity.refused"]
    summary = [r for r in audit if r["event"] == "integrity.refused.summary"]
    assert len(full) == 5 and sum(r["suppressed"] for r in summary) == 95  # every one accounted for


def test_a_non_finite_loss_stops_the_stage_and_is_audited(tmp_path):
    integrity = _integrity(tmp_path)
    integrity.check_loss(0.25, 3)
    integrity.check_loss(None, 4)  # a stage without a loss
    with pytest.raises(StageError, match="the loss of step 5 is nan: the stage stops before saving anything"):
        integrity.check_loss(float("nan"), 5)
    integrity.close()
    assert [(r["event"], r["step"]) for r in _records(tmp_path / "audit.jsonl")] == [("integrity.loss", 5)]


def test_no_checkpoint_ever_holds_a_non_finite_value(tmp_path):
    checkpoints = CheckpointDir(tmp_path / "checkpoints")
    good = {"stage": {"weights": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}},
            "step": 2, "rng": torch.ByteTensor([1, 2])}
    checkpoints.save(2, good)
    bad = {"stage": {"weights": {"w": torch.tensor([1.0, float("nan")])},
                     "optimizer": {"state": {0: {"exp_avg": torch.tensor([float("inf")])}}}}, "step": 3}
    assert non_finite(bad) == ["stage.weights.w", "stage.optimizer.state.0.exp_avg"]
    with pytest.raises(StageError, match=r"refusing to save checkpoint step 3: 2 tensors hold NaN/Inf values "
                                         r"\(stage.weights.w, stage.optimizer.state.0.exp_avg\); the last "
                                         r"checkpoint \(2\) holds finite ones"):
        checkpoints.save(3, bad)
    assert checkpoints.steps() == [2] and not checkpoints.file(3).exists()


def test_the_integrity_table_is_checked_where_the_job_loads():
    with pytest.raises(ConfigError, match="refuse_factor 5.0 is below warn_factor 10.0"):
        IntegrityConfig(refuse_factor=5.0)
    from tests.support.runtime import example_job
    assert example_job().integrity == IntegrityConfig()
