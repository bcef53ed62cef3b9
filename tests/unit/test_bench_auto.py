"""`bench wan --auto`'s verdict: auto against the best fixed rung, picked on all rounds but one and
timed on that one, in s/step and per compute; and which rungs the later rounds time at a slow rate."""
import pytest

from nebula.bench.wan_auto import contenders, verdict

CHOSE_NONE = {"forward": ["none"], "backward": ["none"]}


def row(codec, s_per_step, compute, round_=1, wire=0.01):
    r = {"forward": codec, "link_mbit": 60.0, "rtt_ms": 80.0, "s_per_step": s_per_step, "round": round_,
         "compute_a_s": compute, "compute_b_s": compute, "wire_s": wire}
    return r | ({"chosen": CHOSE_NONE} if codec == "auto" else {})


def test_the_luckiest_phase_is_not_the_best_rung_the_other_rounds_time_it():
    """Three compute-bound rungs that all run at ~0.91 s/step; int8's round-1 phase was lucky (0.86).
    The fastest phase makes an `auto` as fast as any rung look 5% slow; the held-out time does not."""
    times = [{"auto": 0.91, "none": 0.92, "int8": 0.86, "fp16": 0.91},
             {"auto": 0.91, "none": 0.90, "int8": 0.93, "fp16": 0.92},
             {"auto": 0.91, "none": 0.91, "int8": 0.92, "fp16": 0.90}]
    rows = [row(codec, t, 0.9, k) for k, round_ in enumerate(times, 1) for codec, t in round_.items()]
    v = verdict(rows, 60.0)
    assert v["auto_vs_fastest_phase"] == pytest.approx(0.86 / 0.91, abs=1e-3) and v["auto_vs_fastest_phase"] < 0.95
    # round 1 held out: none is fastest over rounds 2 and 3 (0.905); rounds 2 and 3 held out: int8
    assert v["best_fixed"] == ["none", "int8"]
    assert v["best_s_per_step"] == pytest.approx((0.92 + 0.93 + 0.92) / 3, abs=1e-3)
    assert v["auto_vs_best"] == pytest.approx(0.9233 / 0.91, abs=1e-3) and not v["lossy_chosen"]
    assert v["auto_rounds"] == [0.91] * 3
    assert v["round_spread"] == pytest.approx(0.01 / 0.91, abs=1e-3)  # the median stdev / mean: none's, fp16's
    assert v["none_s_per_step"] == 0.92


def test_per_compute_takes_out_the_compute_a_phase_happened_to_have():
    rows = [row("auto", 1.332, 0.98), row("none", 1.384, 1.025), row("int8", 1.228, 0.92),  # 6% less compute
            row("auto", 1.30, 0.96, 2), row("none", 1.35, 1.0, 2), row("int8", 1.25, 0.93, 2)]
    v = verdict(rows, 60.0)
    assert v["best_fixed"] == ["int8"] and v["best_s_per_step"] == pytest.approx((1.25 + 1.228) / 2, abs=1e-3)
    per = {(r["forward"], r["round"]): r["s_per_step"] / r["compute_a_s"] for r in rows}
    assert v["best_fixed_per_compute"] == ["int8"]  # int8 1.335 and 1.344 per compute, none 1.350 and 1.350
    auto = (per["auto", 1] + per["auto", 2]) / 2
    assert v["auto_vs_best_per_compute"] == pytest.approx((per["int8", 1] + per["int8", 2]) / 2 / auto, abs=1e-3)
    assert v["auto_vs_best_per_compute"] > v["auto_vs_best"]


def test_round_two_times_the_rungs_whose_wire_can_hide_and_at_least_two():
    fast = [row("auto", 0.9, 0.9, wire=0.08), row("none", 0.9, 0.9, wire=0.08), row("int8", 0.9, 0.9, wire=0.02),
            row("int8(lowrank(0.5))", 0.9, 0.8, wire=0.013), row("int8(lowrank(0.1))", 0.9, 0.9, wire=0.003)]
    # at 1 Mbit/s: none 4.8 s, int8 1.2 s, lowrank(0.5) 0.78 s, lowrank(0.1) 0.18 s of wire; compute 0.9 s
    assert contenders(fast, 1.0) == ["int8(lowrank(0.1))", "int8(lowrank(0.5))"]
    assert contenders(fast, 0.25) == ["int8(lowrank(0.1))", "int8(lowrank(0.5))"]  # none hides but two are kept
    assert contenders(fast, 60.0) == ["int8(lowrank(0.1))", "int8(lowrank(0.5))", "int8", "none"]
