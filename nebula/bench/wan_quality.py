"""`nebula bench wan --quality`: Table 5's quality column and Figure 9's loss curves.

Each setting trains the scenario's job for the same number of steps from the same initialisation
(stages seed torch from [train].seed, and the example order from the same seed), with that setting's
codecs on the benchmarked link from the first step, then the scenario scores it (e.g. on a held-out
test set by cross-site inference, through the same codecs). Quality does not depend on
the link rate, so the sites run as local processes over loopback (real gateways, CURVE, wire
encode/decode and codecs), one run per setting: settings cannot share a run, since each must start
from the same weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from nebula.bench.wan import (_workdir, base_job, chosen_settings, override_train, per_step_link, progress,
                              read_records, run_job, set_compression)

QUICK_STEPS = 20


def run_quality(args: argparse.Namespace) -> int:
    from nebula.bench.scenarios import load_scenario
    from nebula.plots import plot_curves

    scenario = load_scenario(args.scenario)
    settings = chosen_settings(args)
    with _workdir(args.workdir) as work:
        rows, curves = [], {}
        for forward, backward in settings:
            job = quality_job(args, forward, backward)
            run = work / slug(forward, backward)
            progress(f"quality: {forward} + {backward}, {job['train']['steps']} steps")
            run_job(run, job, label=f"{forward}+{backward}")
            row, curves[f"{forward} + {backward}"] = summarise_quality(run, job, forward, backward, scenario)
            rows.append(row)
        base = rows[0]["s_per_step"]
        for row in rows:
            row["speedup"] = round(base / row["s_per_step"], 3)
        plot_path = args.plot or (work / "loss.png" if args.workdir else Path("runs/bench-wan-loss.png"))
        steps = rows[0]["steps"]
        plot_curves(curves, plot_path, f"{job['job']['name']}: training loss per compression setting", "training loss",
                    smooth=max(1, steps // 20))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_quality(rows, plot_path, scenario.quality_key)
    return 0


def slug(forward: str, backward: str) -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in f"{forward}__{backward}")


def quality_job(args: argparse.Namespace, forward: str, backward: str) -> dict:
    from nebula.bench.scenarios import load_scenario

    raw, link = base_job(args)
    steps = args.steps or (QUICK_STEPS if args.quick else raw["train"]["steps"])
    raw["train"].update(steps=steps, checkpoint_every=steps, log_every=max(1, steps // 10))
    override_train(raw, args)
    raw = load_scenario(args.scenario).quality_job(raw, args.quick)
    set_compression(raw, link, {"forward": forward, "backward": backward})
    raw["bench"] = {"link": link, "scenario": args.scenario}
    return raw


def summarise_quality(run: Path, job: dict, forward: str, backward: str, scenario) -> tuple[dict, list]:
    link = job["bench"]["link"]
    src, dst = link.split("->")
    driver = next(iter(job["stages"]))
    sink = next(name for name in job["stages"] if (run / name / "metrics.jsonl").exists()
                and any("loss" in r for r in read_records(run / name / "metrics.jsonl")))
    losses = [(r["step"], r["loss"]) for r in read_records(run / sink / "metrics.jsonl") if "loss" in r]
    step_s = [r["step_s"] for r in read_records(run / driver / "metrics.jsonl")][1:]  # step 1: warm-up
    fwd = per_step_link(run / src / "link.jsonl", "forward", link)
    bwd = per_step_link(run / dst / "link.jsonl", "backward", link)
    ratio = lambda sums: round(sum(v["wire"] for v in sums.values()) / sum(v["raw"] for v in sums.values()), 4) \
        if sums else None  # noqa: E731
    row = {"forward": forward, "backward": backward, "link": link, "link_mbit": None,  # loopback: quality only
           "s_per_step": round(statistics.fmean(step_s), 3), "speedup": None, "overlap_ratio": None,
           "forward_ratio": ratio(fwd), "backward_ratio": ratio(bwd), "steps": len(losses),
           "final_loss": round(statistics.fmean(v for _, v in losses[-max(1, len(losses) // 10):]), 4),
           **scenario.quality(run, job)}
    return row, losses


def print_quality(rows: list[dict], plot_path: Path, key: str) -> None:
    name = key.upper() if len(key) <= 5 else key
    print(f"{'forward':<20}{'backward':<20}{'fwd ratio':>10}{'bwd ratio':>10}{'steps':>7}"
          f"{'final loss':>11}{name:>8}{'d' + name:>8}{'s/step':>8}")
    base = rows[0][key]
    for r in rows:
        bwd = "-" if r["backward_ratio"] is None else f"{r['backward_ratio']:.3f}"
        print(f"{r['forward']:<20}{r['backward']:<20}{r['forward_ratio']:>10.3f}{bwd:>10}{r['steps']:>7}"
              f"{r['final_loss']:>11.3f}{r[key]:>8.2f}{r[key] - base:>8.2f}{r['s_per_step']:>8.2f}")
    within = [r for r in rows[1:] if abs(r[key] - base) <= 0.5]
    print(f"\n{len(within)} of {len(rows) - 1} compressed settings within 0.5 {name} of uncompressed "
          f"({rows[0]['steps']} steps each, loopback; s/step here is compute-bound); loss curves: {plot_path}")
