"""`bench wan --auto`'s verdict: auto against the best fixed rung, in s/step and per compute."""
import pytest

from nebula.bench.wan_auto import verdict


def row(codec, s_per_step, compute, chosen=None):
    r = {"forward": codec, "link_mbit": 60.0, "rtt_ms": 80.0, "s_per_step": s_per_step,
         "compute_a_s": compute, "compute_b_s": compute}
    return r | ({"chosen": chosen} if chosen else {})


def test_a_rung_faster_only_because_its_phase_computed_less_does_not_beat_auto_per_compute():
    rows = [row("auto", 1.332, 0.98, {"forward": ["none"], "backward": ["none"]}),
            row("none", 1.384, 1.025), row("int8", 1.228, 0.92)]  # int8's phase: 6% less compute
    v = verdict(rows, 60.0)
    assert v["best_fixed"] == "int8" and v["auto_vs_best"] == pytest.approx(1.228 / 1.332, abs=1e-3)
    per = {r["forward"]: r["s_per_step"] / r["compute_a_s"] for r in rows}
    assert v["best_fixed_per_compute"] == "int8"
    assert v["auto_vs_best_per_compute"] == pytest.approx(per["int8"] / per["auto"], abs=1e-3)
    assert v["auto_vs_best_per_compute"] > v["auto_vs_best"] and not v["lossy_chosen"]
    assert v["none_s_per_step"] == 1.384
