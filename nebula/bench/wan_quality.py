"""`nebula bench wan --quality`: Table 5's BLEU column and Figure 9's loss curves.

Each setting trains the scenario's job for the same number of steps from the same initialisation
(the stages seed torch from [train].seed, and the example schedule from the same seed), with that
setting's codecs from the first step, then scores BLEU on the held-out test set by cross-site
inference (HeadRunner.evaluate: the encoder's tensors go through the same codec to the decoder,
which holds the references). Quality does not depend on the link rate, so the sites run as local
processes over loopback (real gateways, CURVE, wire encode/decode and codecs), one run per setting:
settings cannot share a run here, since each must start from the same weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from nebula.bench.wan import (_workdir, chosen_job, chosen_settings, override_train, per_step_link, progress,
                              read_records, run_job)

QUICK_STEPS, QUICK_EVAL = 20, 50


def run_quality(args: argparse.Namespace) -> int:
    settings = chosen_settings(args)
    with _workdir(args.workdir) as work:
        rows, curves = [], {}
        for forward, backward in settings:
            job = quality_job(chosen_job(args), forward, backward, args)
            run = work / slug(forward, backward)
            progress(f"quality: {forward} + {backward}, {job['train']['steps']} steps")
            run_job(run, job, label=f"{forward}+{backward}")
            row, curves[f"{forward} + {backward}"] = summarise_quality(run, job, forward, backward)
            rows.append(row)
        base = rows[0]["s_per_step"]
        for row in rows:
            row["speedup"] = round(base / row["s_per_step"], 3)
        plot_path = args.plot or (work / "loss.png" if args.workdir else Path("runs/bench-wan-loss.png"))
        plot(curves, plot_path, rows[0]["steps"])
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_quality(rows, plot_path)
    return 0


def slug(forward: str, backward: str) -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in f"{forward}__{backward}")


def quality_job(job_file: Path, forward: str, backward: str, args: argparse.Namespace) -> dict:
    import tomllib

    from nebula.runtime.job import load_job

    raw = tomllib.loads(job_file.read_text())
    raw["job"]["data"] = load_job(job_file).data
    steps = args.steps or (QUICK_STEPS if args.quick else raw["train"]["steps"])
    raw["train"].update(steps=steps, checkpoint_every=steps, log_every=max(1, steps // 10))
    override_train(raw, args)
    if args.quick:
        raw["stages"]["encoder"]["eval_examples"] = QUICK_EVAL
    raw["compression"] = {"forward": forward, "backward": backward}
    return raw


def summarise_quality(run: Path, job: dict, forward: str, backward: str) -> tuple[dict, list[float]]:
    head, tail = list(job["stages"])
    losses = [r["loss"] for r in read_records(run / tail / "metrics.jsonl")]
    step_s = [r["step_s"] for r in read_records(run / head / "metrics.jsonl")][1:]  # step 1: warm-up
    fwd = per_step_link(run / head / "link.jsonl", "forward")
    bwd = per_step_link(run / tail / "link.jsonl", "backward")
    scores = json.loads((run / head / "scores.json").read_text())
    row = {"forward": forward, "backward": backward, "link_mbit": None,  # loopback: quality only
           "s_per_step": round(statistics.fmean(step_s), 3), "speedup": None, "overlap_ratio": None,
           "forward_ratio": round(sum(v["wire"] for v in fwd.values()) / sum(v["raw"] for v in fwd.values()), 4),
           "backward_ratio": round(sum(v["wire"] for v in bwd.values()) / sum(v["raw"] for v in bwd.values()), 4),
           "bleu": round(scores["bleu"], 2), "test_sentences": scores["n"], "steps": len(losses),
           "final_loss": round(statistics.fmean(losses[-max(1, len(losses) // 10):]), 4)}
    return row, losses


def plot(curves: dict[str, list[float]], out: Path, steps: int) -> None:
    """Figure 9: training loss per setting (moving average over ~5% of the steps)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, steps // 20)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, losses in curves.items():
        smooth = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {window})")
    ax.set_title("ABNet-Cloud es->en: training loss per compression setting")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def print_quality(rows: list[dict], plot_path: Path) -> None:
    print(f"{'forward':<20}{'backward':<9}{'fwd ratio':>10}{'bwd ratio':>10}{'steps':>7}"
          f"{'final loss':>11}{'BLEU':>7}{'dBLEU':>7}{'s/step':>8}")
    base = rows[0]["bleu"]
    for r in rows:
        print(f"{r['forward']:<20}{r['backward']:<9}{r['forward_ratio']:>10.3f}{r['backward_ratio']:>10.3f}"
              f"{r['steps']:>7}{r['final_loss']:>11.3f}{r['bleu']:>7.2f}{r['bleu'] - base:>7.2f}{r['s_per_step']:>8.2f}")
    within = [r for r in rows[1:] if abs(r["bleu"] - base) <= 0.5]
    print(f"\n{len(within)} of {len(rows) - 1} compressed settings within 0.5 BLEU of uncompressed "
          f"({rows[0]['test_sentences']} test sentences, {rows[0]['steps']} steps each, loopback; "
          f"s/step here is compute-bound); loss curves: {plot_path}")
