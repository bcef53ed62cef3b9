"""`bench wan --auto`'s verdict: auto against the best fixed rung, picked on all rounds but one and
timed on that one, in s/step and per compute; and which rungs the later rounds time at a slow rate."""
import pytest

from nebula_lab.bench.wan_auto import contenders, verdict

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


def test_the_change_bench_counts_steps_from_each_rate_change_and_times_each_segments_tail(tmp_path):
    """`--auto --change` from the stages' own files: moves counted from the step after which the rate
    changed, per direction; the tail's rungs are those `auto` chose (ids and masks are not)."""
    import json

    from nebula_lab.bench.wan_change import TAIL, summarise

    job = {"stages": {"enc": {"address": "a/enc/0"}, "dec": {"address": "b/dec/0"}}, "bench": {"link": "enc->dec"}}
    ends, after, rates = [10, 20], [0, 10], [60.0, 1.0]
    rung = {"forward": lambda s: "none" if s <= 13 else "int8(lowrank(0.25))",
            "backward": lambda s: "none" if s <= 12 else "int8"}
    for stage, direction, moved in (("enc", "forward", 13), ("dec", "backward", 12)):
        (tmp_path / stage).mkdir()
        steps = [{"kind": "step", "step": s, "step_s": 1.0 if s <= 10 else 1.5, "compute_s": 0.8} for s in range(1, 21)]
        event = {"kind": "event", "event": "compression", "link": "enc->dec", "dir": direction, "step": moved + 1,
                 "old": "none", "new": rung[direction](moved + 1), "trial": False, "goodput_mbit": 0.9}
        (tmp_path / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*steps, event]))
        lines = [{"t": s, "step": s, "link": "enc->dec", "dir": direction, "name": "hidden",
                  "codec": rung[direction](s),
                  "raw": 1_000_000, "wire": 1_000_000 if rung[direction](s) == "none" else 100_000, "encode_s": 0,
                  "auto": True}
                 for s in range(1, 21)]
        lines += [{"t": s, "step": s, "link": "enc->dec", "dir": direction, "name": "ids", "codec": "none",
                   "raw": 8_000, "wire": 8_000, "encode_s": 0} for s in range(1, 21)]
        (tmp_path / stage / "link.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fast, slow = summarise(tmp_path, job, rates, after, ends, 80.0)
    assert fast["lossless"] and fast["forward_first_move"] is None and fast["to_limit"] == pytest.approx(1.0 / 0.8)
    assert (slow["forward_first_move"], slow["backward_first_move"]) == (4, 3)
    assert slow["forward_codecs"] == ["int8(lowrank(0.25))"] and slow["backward_codecs"] == ["int8"]
    assert slow["forward_mb"] == pytest.approx(0.108) and slow["s_per_step"] == 1.5
    assert slow["wire_s"] == pytest.approx(0.108 * 8 / 1.0) and len(slow["moves"]) == 2 and TAIL <= 10
