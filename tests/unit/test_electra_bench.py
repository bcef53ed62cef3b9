"""`nebula bench wan --scenario electra` turns the generator's step records into Tables 3 and 4 with the
right arithmetic: warm-up and last steps untimed, runs pooled as sums (not means of ratios), ratios
against the first row, link bytes only between the two qdisc readings; the credit that hides a delay;
Table 4's emulated device. Synthetic records, no network."""
import argparse
from pathlib import Path

import pytest

from nebula.errors import ConfigError, StageError
from services.electra import bench, bench_report, bench_tables
from services.electra.bench_tables import Config

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
    configs = [Config("one-site", True), Config("170mbit-200ms-c2", False, 170.0, 200.0, 2)]
    one = [bench.step_sums(records([s] * 20), []) for s in (0.5, 0.5, 1.0)]  # round 3: other processes' load
    inter = [bench.step_sums(records([1.0] * 20), [(4, 0), (19, 30_000)]),
             bench.step_sums(records([0.25] * 20), []), bench.step_sums(records([2.0] * 20), [])]
    for runs in (one, inter):
        for sums in runs:
            sums["disc_compute_s"] = 0.4 * sums["steps"]
    rows = bench_tables.table3_rows(configs, {"one-site": one, "170mbit-200ms-c2": inter})
    assert rows[0]["inter_intra"] == 1.0 and rows[0]["link_mbit"] is None
    # pooled: 45 steps x 1000 tokens over 15 + 3.75 + 30 s, not the mean of 1000, 4000 and 500 tokens/s
    assert rows[1]["throughput"] == pytest.approx(45_000 / 48.75, abs=0.1)
    assert rows[1]["inter_intra_rounds"] == [0.5, 2.0, 0.5] and rows[1]["inter_intra"] == 0.5
    assert rows[1]["throughput_runs"] == [1000.0, 4000.0, 500.0] and rows[1]["runs"] == 3
    assert rows[1]["link_bytes_per_token"] == pytest.approx(2.0)  # 30 kB over 15 steps of 1000 tokens
    # the pace model: G computes 0.5 x 48.75 / 45 s a step, D 0.4 s; (T_G + T_D + 0.2 s + wire) / 2 bounds
    t_g, wire = 0.5 * 48.75 / 45, 2000 * 8 / 170e6
    assert rows[1]["model_step_s"] == pytest.approx((t_g + 0.4 + 0.2 + wire) / 2, abs=1e-4)
    assert rows[1]["generator_wait_ms"] == pytest.approx(1000 * 0.5 * 48.75 / 45, abs=0.1)


@pytest.mark.parametrize("t_g, t_d, rtt, credit", [(1.0, 1.0, 0.0, 2), (1.0, 1.0, 0.02, 3), (1.0, 1.0, 0.2, 3),
                                                    (0.1, 0.1, 0.2, 4), (0.1, 0.1, 0.01, 3), (1.0, 0.3, 0.5, 2)])
def test_the_hiding_credit_is_the_least_under_which_g_never_waits_for_a_pace(t_g, t_d, rtt, credit):
    assert bench_tables.hiding_credit(t_g, t_d, rtt) == credit
    period = lambda c: max(t_g, t_d, (t_g + t_d + rtt) / c)  # noqa: E731 - the model the table prints
    assert period(credit) == max(t_g, t_d) and (credit == 2 or period(credit - 1) > max(t_g, t_d))


def test_table4_ratios_are_against_n_1_and_the_auto_row_carries_its_evidence():
    configs = [Config(f"n{n}", False, 170.0, ranks=n) for n in (1, 2)] + [Config("auto", False, 170.0, ranks="auto")]
    evidence = {"stage": "disc", "ranks": 4, "t_generator_s": {"generator": 0.2}, "t_sub_s": 0.7, "most": 4,
                "micro_batch": 16}
    results = {"n1": [bench.step_sums(records([1.0] * 20, busy=0.25), [])],
               "n2": [bench.step_sums(records([1.0] * 20, tokens=2000, busy=0.5), [])],
               "auto": [bench.step_sums(records([1.1] * 20, tokens=4000, busy=0.95), [])]}
    rows = bench_tables.table4_rows(configs, results, evidence, DEVICE)
    assert [r["n"] for r in rows] == [1, 2, 4] and [r["auto"] for r in rows] == [False, False, True]
    assert [r["throughput_ratio"] for r in rows] == [1.0, 2.0, pytest.approx(4000 / 1.1 / 1000, abs=1e-3)]
    assert rows[2]["generator_busy"] == pytest.approx(0.95) and rows[2]["calibration"] == evidence
    assert "calibration" not in rows[0]


DEVICE = {"paper_d": {"hidden": 170, "layers": 4, "heads": 2, "ffn": 680}, "t_generator_s": 0.1,
          "t_paper_d_s": 0.35, "slowdown": 4.0, "device_time_s": 1.4, "r": 14.0, "paper_d_numel": 6_300_000,
          "stand_in_numel": 240_000, "sync_numel": 6_060_000}


def test_table_4_alone_prints_its_label_evidence_and_verdict(capsys):
    configs = [Config("n1", False, 170.0, ranks=1), Config("n2", False, 170.0, ranks=2),
               Config("auto", False, 170.0, ranks="auto")]
    evidence = {"stage": "disc", "ranks": 3, "t_generator_s": {"generator": 0.281}, "t_sub_s": 0.600, "most": 4,
                "micro_batch": 16}
    results = {"n1": [bench.step_sums(records([1.0] * 20, busy=0.37), [])],
               "n2": [bench.step_sums(records([1.0] * 20, tokens=1900, busy=0.7), [])],
               "auto": [bench.step_sums(records([1.0] * 20, tokens=2380, busy=0.96), [])]}
    bench_report.print_tables(bench_tables.table4_rows(configs, results, evidence, DEVICE))
    out = capsys.readouterr().out
    assert "Table 3" not in out and "DEVICE-TIME EMULATION" in out and "not of compute scaling" in out
    assert "1.400 s = k 4 x 0.350 s" in out and "n in [0.9 r, r / 0.85] = [1.92, 2.51]" in out
    assert "auto n = 3: generator busy 0.96 (met, target >= 0.95); 2.38x = 0.79 x n per sub; ceiling 1.00" in out
    assert "n = 2: 1.90x = 0.95 x n (met, target >= 0.85 x n); ceiling 1.00" in out
    assert "each all-reduce carries 6,300,000 gradient values" in out
    # r = 7: n = 8 at 0.86 x n sits on its ceiling 7 / 8, so it says what it measures
    low = {**DEVICE, "r": 7.0}
    rows = bench_tables.table4_rows([Config("n1", False, 170.0, ranks=1), Config("n8", False, 170.0, ranks=8)],
                                    {"n1": results["n1"], "n8": [bench.step_sums(records([1.0] * 20, tokens=6880,
                                                                                         busy=1.0), [])]},
                                    evidence, low)
    assert rows[1]["per_sub"] == 0.86 and rows[1]["per_sub_ceiling"] == 0.875
    bench_report.print_verdict([], rows)
    assert "at its ceiling r / n = 0.88: this measures r, not the runtime" in capsys.readouterr().out
    assert "inter/intra" not in out.split("targets:")[1]


def test_jobs_at_the_tables_sizes_and_the_emulated_device(tmp_path):
    one_site = bench_tables.bench_job(bench.SCENARIO, Config("one-site", True), tmp_path, 10, None, 3)
    assert {s["address"].split("/")[0] for s in one_site["stages"].values()} == {"a"}
    assert {s["max_len"] for s in one_site["stages"].values()} == {512} and one_site["train"]["batch_size"] == 8
    t3 = bench_tables.bench_job(bench.SCENARIO, Config("x", False, 170.0, 200.0, 3), tmp_path, 10, 7, 3)
    assert t3["schedule"] == {"name": "forward-only", "credit": 3} and t3["train"]["seed"] == 7
    assert t3["train"]["steps"] == bench.WARMUP + 10 + 1
    # CPU cores even on a GPU host: with "auto", a 16-core H100 machine put both subs of n = 2 on one GPU
    assert {s["device"] for s in t3["stages"].values()} == {"cpu"}
    base = bench_tables.bench_job(bench.SCENARIO, Config("t4", False, 170.0), tmp_path, 10, None, 4)
    fixed = bench_tables.device_job(base, DEVICE, 4, 16)
    auto = bench_tables.device_job(base, DEVICE, "auto", 16)
    assert (fixed["train"]["batch_size"], fixed["train"]["micro_batches"]) == (4 * base["train"]["batch_size"], 4)
    assert auto["stages"]["disc"]["ranks"] == "auto" and auto["stages"]["disc"]["max_ranks"] == 16
    assert fixed["stages"]["disc"]["device_time"] == 1.4 and fixed["stages"]["disc"]["size"] == bench_tables.STAND_IN
    assert fixed["stages"]["disc"]["sync_numel"] == DEVICE["sync_numel"]  # the all-reduce at the paper D's size
    g_core, d_cores = bench_tables.cores()
    assert fixed["stages"]["generator"]["cpus"] == g_core and fixed["stages"]["disc"]["cpus"] == d_cores
    assert "device_time" not in base["stages"]["disc"]  # device_job copies, it does not change the base


def test_paper_proportioned_d_is_twice_the_layers_and_four_thirds_the_width():
    assert bench_tables.paper_proportioned({"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072}) == \
        {"hidden": 1020, "layers": 24, "heads": 12, "ffn": 4080}  # 1024 rounded to a multiple of 12 heads
    assert bench_tables.paper_proportioned({"hidden": 128, "layers": 2, "heads": 2, "ffn": 512}) == \
        {"hidden": 170, "layers": 4, "heads": 2, "ffn": 680}


def test_compression_options_are_refused_not_ignored():
    args = argparse.Namespace(**bench.COMPRESSION_ONLY, bound_factor=5.0, steps=None, rounds=None, max_ranks=None,
                              slowdown=None, rtt_ms=None)
    bench.check_options(args, 5.0)
    args.setting = [["fp16", "int8"]]
    with pytest.raises(ConfigError, match="--setting does not apply"):
        bench.check_options(args, 5.0)


def test_the_all_reduce_of_table_4_is_sized_as_the_paper_proportioned_d(tmp_path):
    """The stand-in's gradients plus sync_numel zeros = every weight of the paper-proportioned D (embeddings,
    layers, the RTD and tied CLM heads), ~24x the stand-in's at the bench's vocabulary."""
    import torch

    from services.models.vocab import VocabMap
    vocab = tmp_path / "vocab.json"
    VocabMap(torch.arange(1000), 2000, 3).save(vocab)
    paper = bench_tables.paper_proportioned(bench_tables.SIZES["generator"])
    big, small = (bench_tables.discriminator_numel(vocab, size, 64) for size in (paper, bench_tables.STAND_IN))
    hidden, ffn, layers = paper["hidden"], paper["ffn"], paper["layers"]
    per_layer = 4 * (hidden * hidden + hidden) + 2 * hidden * ffn + ffn + hidden + 2 * 2 * hidden  # + 2 LayerNorms
    assert big > 1000 * hidden + layers * per_layer  # embeddings and layers, at least
    assert big > 10 * small > 0
