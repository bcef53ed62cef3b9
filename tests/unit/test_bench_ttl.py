"""nebula_lab.bench.wan_ttl: steps to a target loss from real one-site training of a tiny GPT, a finished
run kept for any target its curve answers, and a setting that misses the target reported, not dropped."""
import statistics

import pytest
import tomllib

from nebula_lab.bench.wan_ttl import combine, setting_job, train_to_target, verdict
from services.gpt.bench import SCENARIO
from tests.support.gpt import gpt_job

SETTING = {"name": "bottleneck 4, int8", "forward": "int8", "backward": "int8", "schedule": None,
           "stages": {"bottleneck": 4}}


def tiny_raw(tmp_path) -> dict:
    return tomllib.loads(gpt_job(tmp_path / "source").read_text())


def test_training_stops_at_the_first_evaluation_at_or_below_the_target_and_a_finished_run_is_kept(tmp_path):
    job = setting_job(tiny_raw(tmp_path), SETTING, seed=1, steps=8, every=2)
    run = tmp_path / "run"
    far = train_to_target(run, job, target=100.0, every=2, scenario=SCENARIO)
    assert far["reached"] and far["steps"] == 2 and [s for s, _ in far["curve"]] == [2]
    assert 0 < far["bytes_per_token_fwd"] < 16 * 4  # a 4-wide int8 code (+ scales, ids), not d = 16 floats
    stamp = (run / "row.json").stat().st_mtime_ns
    again = train_to_target(run, job, target=100.0, every=2, scenario=SCENARIO)
    assert again == far and (run / "row.json").stat().st_mtime_ns == stamp  # kept, not trained again


def test_a_target_never_reached_costs_the_whole_budget_and_says_so(tmp_path):
    job = setting_job(tiny_raw(tmp_path), SETTING, seed=1, steps=4, every=2)
    row = train_to_target(tmp_path / "run", job, target=0.0, every=2, scenario=SCENARIO)
    assert not row["reached"] and row["steps"] == 4 and [s for s, _ in row["curve"]] == [2, 4]
    assert row["final_loss"] == row["curve"][-1][1]


def test_verdict_takes_the_first_evaluation_at_or_below_the_target():
    curve = [[25, 7.0], [50, 6.5], [75, 6.6], [100, 6.4]]
    assert verdict(curve, 6.5, 200) == {"steps": 50, "reached": True, "final_loss": 6.5, "target": 6.5}
    assert verdict(curve, 6.0, 200)["steps"] == 200


def test_rows_keep_a_setting_that_missed_the_target_without_a_time():
    settings = [{"name": "dense", "forward": "bf16", "backward": "bf16", "stages": {}},
                {"name": "code", "forward": "int4", "backward": "int8", "stages": {}, "seeds": 1}]
    run = {"bytes_per_token_fwd": 10.0, "bytes_per_token_bwd": 20.0}
    quality = {("dense", 1): {**run, **verdict([[100, 6.4]], 6.5, 300)},
               ("dense", 2): {**run, **verdict([[100, 6.6], [200, 6.5]], 6.5, 300)},
               ("code", 1): {**run, **verdict([[300, 6.7]], 6.5, 300)}}
    speed = {("dense", "bound"): {"s_per_step": 2.0, "link_mbit": 10.0, "rtt_ms": 0.0, "wire_s": 1.5},
             ("code", "bound"): {"s_per_step": 0.5, "link_mbit": 10.0, "rtt_ms": 0.0, "wire_s": 0.1}}
    dense, code = combine(settings, [1, 2], quality, speed, 6.5)  # a row per setting and rate timed
    assert dense["steps"] == 150 and dense["T_s"] == 300.0 and dense["T_vs_dense"] == 1.0
    half = 12.706 * statistics.stdev([100, 200]) / 2 ** 0.5  # Student's t over the 2 seeds
    assert dense["steps_interval"] == pytest.approx([150 - half, 150 + half], abs=1e-3)
    assert dense["T_vs_dense_per_seed"] == [1.0, 1.0]
    assert code["seeds"] == [1] and not code["reached"] and code["T_s"] is None and code["T_vs_dense"] is None
    assert code["steps_interval"] is None  # one seed: no interval


def test_auto_takes_the_steps_of_the_setting_trained_with_the_rung_it_chose_on_that_link():
    dense = {"name": "dense fp32", "forward": "none", "backward": "none", "stages": {}}
    low = {"name": "dense int8(lowrank(0.1))", "forward": "int8(lowrank(0.1))", "backward": "int8(lowrank(0.1))",
           "stages": {}}
    auto = {"name": "auto", "forward": "auto", "backward": "auto", "stages": {}}
    run = {"bytes_per_token_fwd": 10.0, "bytes_per_token_bwd": 20.0}
    quality = {("dense fp32", 1): {**run, **verdict([[100, 6.4]], 6.5, 300)},
               ("dense int8(lowrank(0.1))", 1): {**run, **verdict([[100, 6.6], [200, 6.5]], 6.5, 300)}}

    def timed(s_per_step: float, chose: dict | None = None) -> dict:
        return {"s_per_step": s_per_step, "link_mbit": 10.0, "rtt_ms": 0.0, "wire_s": 0.1,
                **({"chosen": chose} if chose is not None else {})}
    lossy = {"forward": ["int8(lowrank(0.1))"], "backward": ["int8(lowrank(0.1))"]}
    speed = {("dense fp32", "bound"): timed(4.0), ("dense int8(lowrank(0.1))", "bound"): timed(1.0),
             ("auto", "bound"): timed(1.1, lossy),
             ("auto", "png"): timed(0.5, {"forward": ["none", "fp16"], "backward": ["none"]})}
    rows = combine([dense, low, auto], [1], quality, speed, 6.5)
    bound, png = rows[2], rows[5]
    assert bound["steps_from"] == "dense int8(lowrank(0.1))" and bound["steps"] == 200 and bound["T_s"] == 220.0
    assert bound["T_vs_dense"] == 0.55 and bound["reached"]
    assert png["steps_from"] is None and png["steps"] is None and png["T_s"] is None  # two rungs: not measured


def test_every_round_times_every_rate_the_bound_ones_from_the_first_round_on(tmp_path, monkeypatch):
    """--rounds 2 alternates png, 1x, 2x, 5x twice: the bound rates are calibrated from the first round's png
    run and join that round (they were left to the second round alone, so each got half the rounds)."""
    import argparse

    from nebula_lab.bench import wan_ttl
    ran = []

    def measure(run, job, mbit, rtt):
        ran.append(run.parent.name + "/" + run.name.rsplit("-", 1)[0])
        return [{"s_per_step": 1.0 + mbit / 1000} for _ in job["group"]]

    monkeypatch.setattr(wan_ttl, "measure_rate", measure)
    monkeypatch.setattr(wan_ttl, "speed_job", lambda args, raw, group, work, scenario: {"group": group})
    monkeypatch.setattr(wan_ttl, "bound_rate", lambda row, factor: round(10.0 / factor, 2))
    args = argparse.Namespace(rounds=2, bound_factors=[1.0, 2.0, 5.0], bound_factor=5.0, rtt_ms=None)
    rows = wan_ttl.measure_speed(args, tmp_path, {}, [dict(SETTING, name="dense")], SCENARIO)
    labels = ["png", "1x", "2x", "5x"]
    assert ran == [f"round{r}/{label}" for r in (1, 2) for label in labels]
    assert all(len(rows[("dense", label)]["round_steps"]) == 2 for label in labels)
