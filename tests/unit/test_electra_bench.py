"""`nebula bench wan --scenario electra` turns the generator's step records into Tables 3 and 4 with the
right arithmetic: warm-up and last steps untimed, runs pooled as sums (not means of ratios), ratios
against the first row, link bytes only between the two qdisc readings. Synthetic records, no network."""
import argparse
from pathlib import Path

import pytest

from nebula.errors import ConfigError, StageError
from services.electra import bench
from services.electra.bench import Config

ROOT = Path(__file__).resolve().parents[2]


def records(step_s: list[float], tokens: float = 1000.0, busy: float = 0.5, sent: int = 2000) -> list[dict]:
    """What the generator's metrics.jsonl holds: one record per step."""
    return [{"kind": "step", "step": i + 1, "step_s": s, "compute_s": busy * s, "loss": 9.0,
             "stats": {"tokens": tokens, "masked": 150.0, "sequences": 16.0},
             "sent": {"generator->disc:forward": sent}} for i, s in enumerate(step_s)]


def test_only_the_steps_between_warm_up_and_the_last_are_timed():
    # warm-up steps are fast (G runs ahead on its credit) and the last saves a checkpoint: neither counts
    recs = records([0.1] * bench.WARMUP + [0.5] * 10 + [3.0])
    sums = bench.step_sums(recs, [])
    assert sums["steps"] == 10 and sums["seconds"] == pytest.approx(5.0)
    row = bench.rates(sums)
    assert row["throughput"] == pytest.approx(2000.0)  # 10 x 1000 tokens / 5 s
    assert row["generator_busy"] == pytest.approx(0.5)
    assert row["bytes_per_token"] == pytest.approx(2.0)
    assert row["link_bytes_per_token"] is None  # one site: no qdisc


def test_link_bytes_are_those_counted_between_the_two_readings_per_token_of_those_steps():
    recs = records([0.5] * 16)
    # readings when 4 and 15 records were written: steps 5..15, 11 x 1000 tokens
    sums = bench.step_sums(recs, [(4, 10_000), (15, 65_000)])
    assert sums["link_tokens"] == 11_000
    assert bench.rates(sums)["link_bytes_per_token"] == pytest.approx(5.0)


def test_too_few_records_is_a_clear_error():
    with pytest.raises(StageError, match="timed steps"):
        bench.step_sums(records([0.5] * bench.WARMUP), [], "t3 one-site")


def test_runs_pool_as_sums_and_table3_ratios_are_the_median_round_against_one_site():
    configs = [Config("one-site", True, None), Config("170mbit", False, 170.0)]
    one = [bench.step_sums(records([s] * 20), []) for s in (0.5, 0.5, 1.0)]  # round 3: other processes' load
    inter = [bench.step_sums(records([1.0] * 20), [(4, 0), (19, 30_000)]),
             bench.step_sums(records([0.25] * 20), []), bench.step_sums(records([2.0] * 20), [])]
    rows = bench.table3_rows(configs, {"one-site": one, "170mbit": inter})
    assert rows[0]["inter_intra"] == 1.0 and rows[0]["link_mbit"] is None
    # pooled: 45 steps x 1000 tokens over 15 + 3.75 + 30 s, not the mean of 1000, 4000 and 500 tokens/s
    assert rows[1]["throughput"] == pytest.approx(45_000 / 48.75, abs=0.1)
    assert rows[1]["inter_intra_rounds"] == [0.5, 2.0, 0.5] and rows[1]["inter_intra"] == 0.5
    assert rows[1]["throughput_runs"] == [1000.0, 4000.0, 500.0] and rows[1]["runs"] == 3
    assert rows[1]["link_bytes_per_token"] == pytest.approx(2.0)  # 30 kB over 15 steps of 1000 tokens


def test_table4_ratios_are_against_n_1_and_the_auto_row_carries_its_evidence():
    configs = [Config(f"n{n}", False, 170.0, 4.0, n) for n in (1, 2)] + [Config("auto", False, 170.0, 4.0, "auto")]
    evidence = {"stage": "disc", "ranks": 4, "t_generator_s": {"generator": 0.2}, "t_sub_s": 0.7, "most": 4,
                "micro_batch": 16}
    results = {"n1": [bench.step_sums(records([1.0] * 20, busy=0.25), [])],
               "n2": [bench.step_sums(records([1.0] * 20, tokens=2000, busy=0.5), [])],
               "auto": [bench.step_sums(records([1.1] * 20, tokens=4000, busy=0.95), [])]}
    rows = bench.table4_rows(configs, results, evidence)
    assert [r["n"] for r in rows] == [1, 2, 4] and [r["auto"] for r in rows] == [False, False, True]
    assert [r["throughput_ratio"] for r in rows] == [1.0, 2.0, pytest.approx(4000 / 1.1 / 1000, abs=1e-3)]
    assert rows[2]["generator_busy"] == pytest.approx(0.95) and rows[2]["calibration"] == evidence
    assert "calibration" not in rows[0]


def test_table_4_alone_prints_its_table_evidence_and_verdict(capsys):
    configs = [Config("n1", False, 170.0, 4.0, 1), Config("auto", False, 170.0, 4.0, "auto")]
    evidence = {"stage": "disc", "ranks": 3, "t_generator_s": {"generator": 0.281}, "t_sub_s": 0.600, "most": 4,
                "micro_batch": 16}
    results = {"n1": [bench.step_sums(records([1.0] * 20, busy=0.37), [])],
               "auto": [bench.step_sums(records([1.0] * 20, tokens=2380, busy=0.96), [])]}
    rows = bench.table4_rows(configs, results, evidence)
    bench.print_tables(rows, argparse.Namespace(json=False))
    out = capsys.readouterr().out
    assert "Table 3" not in out and "Table 4" in out and "n = ceil(1.1 x 2.14) = 3" in out
    assert "auto n = 3: generator busy 0.96 (met, target >= 0.9), throughput ratio 2.38 = 0.79 x n (NOT met" in out
    assert "inter/intra" not in out.split("targets:")[1]


def test_fixed_n_scales_the_step_and_auto_leaves_it_to_the_launcher(tmp_path):
    fixed = bench.bench_job(bench.SCENARIO, Config("n4", False, 170.0, 4.0, 4), tmp_path, 10, 7, 4)
    auto = bench.bench_job(bench.SCENARIO, Config("auto", False, 170.0, 4.0, "auto"), tmp_path, 10, None, 6)
    assert fixed["train"]["steps"] == bench.WARMUP + 10 + 1 and fixed["train"]["seed"] == 7
    assert (fixed["train"]["batch_size"], fixed["train"]["micro_batches"]) == (4 * auto["train"]["batch_size"], 4)
    assert auto["stages"]["disc"]["ranks"] == "auto" and auto["stages"]["disc"]["max_ranks"] == 6
    assert fixed["stages"]["disc"]["slowdown"] == 4.0 and fixed["stages"]["generator"]["threads"] == 1
    # CPU cores even on a GPU host: with "auto", a 16-core H100 machine put both subs of n = 2 on one GPU
    assert {s["device"] for s in fixed["stages"].values()} == {"cpu"}
    one_site = bench.bench_job(bench.SCENARIO, Config("one-site", True, None), tmp_path, 10, None, 1)
    assert {s["address"].split("/")[0] for s in one_site["stages"].values()} == {"a"}


def test_compression_options_are_refused_not_ignored():
    args = argparse.Namespace(**bench.COMPRESSION_ONLY, bound_factor=5.0, steps=None, rounds=None, max_ranks=None,
                              slowdown=None)
    bench.check_options(args, 5.0)
    args.setting = [["fp16", "int8"]]
    with pytest.raises(ConfigError, match="--setting does not apply"):
        bench.check_options(args, 5.0)
