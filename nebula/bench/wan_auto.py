"""`nebula bench wan --auto`: `compression = "auto"` against every fixed rung of its ladder, same run.

Per link rate (60 Mbit/s, the communication-bound rate calibrated from the 60 Mbit/s run's
uncompressed phase, and that rate / 4), all with `--rtt-ms` (default 80) of propagation delay on the
emulated link, one training run holds one phase per setting: first `auto` (both directions, the
default ladder, from the run's first step as a user would start it; its first 1 + LEAD_IN + AUTO_LEAD
steps are not timed: the time `auto` needs to measure and decide), then each fixed rung of the
ladder both ways. `auto_vs_best` = the fastest fixed rung's s/step / auto's: >= 0.95 is the target,
and where the link is not the bottleneck auto should stay lossless (`lossy_chosen` false).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from nebula.bench import wan
from nebula.codecs.auto import LADDER, AutoSettings
from nebula.runtime.metrics import read_records

AUTO_LEAD = AutoSettings().every  # one more decision window before auto's timed steps
RTT_MS = 80.0
LOWER = 4.0  # the third rate: the communication-bound one / LOWER


def run_auto(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("nebula bench wan --auto: skipped: the emulated WAN link needs root", file=sys.stderr)
        return 2
    rtt = RTT_MS if args.rtt_ms is None else args.rtt_ms
    settings = [("auto", "auto"), *[(spec, spec) for spec in LADDER]]
    with wan._workdir(args.workdir) as work:
        job = wan.bench_job(args, settings, args.steps or 3, work, first_lead=AUTO_LEAD)
        rows = measure(work / "60mbit", job, wan.PAPER_MBIT, rtt)
        bound = wan.bound_rate(next(r for r in rows if r["forward"] == "none"), args.bound_factor)
        wan.progress(f"communication-bound rate: {bound} Mbit/s (uncompressed wire = {args.bound_factor:g} x compute)")
        for rate in (bound, float(f"{bound / LOWER:.3g}")):
            rows += measure(work / f"{rate}mbit", job, rate, rtt)
    verdicts = [verdict(rows, rate) for rate in dict.fromkeys(r["link_mbit"] for r in rows)]
    if args.json:
        print(json.dumps(rows + verdicts, indent=1))
    else:
        wan.print_table(rows)
        print_verdicts(verdicts, rtt)
    return 0


def measure(run, job: dict, rate: float, rtt_ms: float) -> list[dict]:
    rows = wan.measure_rate(run, job, rate, rtt_ms=rtt_ms)
    auto = rows[0]
    auto["chosen"] = chosen(run, job)
    auto["rtt_ms"] = rtt_ms
    return rows


def chosen(run, job: dict) -> dict[str, list[str]]:
    """Direction -> the codecs `auto` used in its timed steps (from each sender's link.jsonl)."""
    link = job["bench"]["link"]
    src, dst = link.split("->")
    steps = set(wan.phase_steps(job)[0][1])
    used: dict[str, list[str]] = {}
    for stage, direction in ((src, "forward"), (dst, "backward")):
        for r in read_records(run / stage / "link.jsonl", kind=None):
            if r.get("auto") and r.get("dir") == direction and r.get("step") in steps:
                used.setdefault(direction, [])
                if r["codec"] not in used[direction]:
                    used[direction].append(r["codec"])
    return used


def per_compute(row: dict) -> float:
    """A phase's s/step over its own compute per step (the two sites' mean): the phases of one run follow
    each other, and on 2 shared cores their compute drifts by up to 16% (measured), more than the wire
    a rung saves where the link is fast; this ratio leaves the wire's share alone."""
    return row["s_per_step"] / ((row["compute_a_s"] + row["compute_b_s"]) / 2)


def verdict(rows: list[dict], rate: float) -> dict:
    at = [r for r in rows if r["link_mbit"] == rate]
    auto, fixed = at[0], at[1:]
    best = min(fixed, key=lambda r: r["s_per_step"])
    best_c = min(fixed, key=per_compute)
    lossy = any(codec != "none" for codecs in auto["chosen"].values() for codec in codecs)
    return {"kind": "verdict", "link_mbit": rate, "rtt_ms": auto["rtt_ms"], "auto_s_per_step": auto["s_per_step"],
            "auto_chosen": auto["chosen"], "best_fixed": best["forward"], "best_s_per_step": best["s_per_step"],
            "auto_vs_best": round(best["s_per_step"] / auto["s_per_step"], 3), "lossy_chosen": lossy,
            "best_fixed_per_compute": best_c["forward"],
            "auto_vs_best_per_compute": round(per_compute(best_c) / per_compute(auto), 3),
            "none_s_per_step": next(r["s_per_step"] for r in fixed if r["forward"] == "none")}


def print_verdicts(verdicts: list[dict], rtt_ms: float) -> None:
    print(f"\nauto against the best fixed rung (RTT {rtt_ms:g} ms; target auto_vs_best >= 0.95; per compute: "
          "each phase's s/step over its own compute, the same ratio with the phases' compute drift taken out):")
    print(f"{'Mbit/s':>8}  {'best fixed':<22}{'s/step':>8}  {'auto chose (fwd / bwd)':<44}{'s/step':>8}{'best/auto':>11}"
          f"{'per compute':>13}")
    for v in verdicts:
        picks = " / ".join(",".join(v["auto_chosen"].get(d, ["-"])) for d in ("forward", "backward"))
        print(f"{v['link_mbit']:>8.3g}  {v['best_fixed']:<22}{v['best_s_per_step']:>8.2f}  {picks:<44}"
              f"{v['auto_s_per_step']:>8.2f}{v['auto_vs_best']:>11.3f}{v['auto_vs_best_per_compute']:>13.3f}")
