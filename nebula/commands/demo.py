"""`nebula demo`: the two-site translation demo on this machine (the README's main job)."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    parser = sub.add_parser("demo", help="train ABNet-Cloud es->en across two local sites, print BLEU")
    parser.add_argument("--job", type=Path, default=None, help="job file (default: deploy/jobs/abnet-es-en.toml)")
    parser.add_argument("--steps", type=int, default=None, help="override the job's [train].steps")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="logs, keys, checkpoints, plot")
    parser.add_argument("--hot-start", type=Path, default=None, metavar="DIR",
                        help="continue from the checkpoints of a one-site run (nebula stage one-site)")
    parser.set_defaults(func=demo)


def demo(args) -> int:
    from nebula.demo import ROOT, run_demo
    job = args.job or ROOT / "deploy" / "jobs" / "abnet-es-en.toml"
    scores = run_demo(job, args.run_dir, args.steps, args.hot_start)
    print(f"\ncross-site BLEU on {scores['n']} held-out test sentences: {scores['bleu']:.2f} "
          f"(sacrebleu, case-insensitive) in {scores['wall_s']:.0f} s")
    for hyp, ref in scores.get("samples", [])[:3]:
        print(f"  hyp: {hyp}\n  ref: {ref}")
    print(f"loss curve: {args.run_dir / 'loss.png'}; logs: {args.run_dir / 'logs'}")
    return 0
