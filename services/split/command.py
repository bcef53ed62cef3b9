"""`nebula split verify | bench`: check a split job against its unsplit model, and measure it.

    nebula split verify --job JOB [--json]       loss and every gradient, split vs unsplit, one step
    nebula split run --job JOB [--workdir D]     the job's sites on this host (gateways, CURVE), trained
    nebula split bench --job JOB [--codecs none,bf16,int8] [--steps 3] [--json]
                                                 per stage: peak memory and step time; per link and
                                                 codec: bytes per token each way (services/split/bench.py)
"""
from __future__ import annotations

import json
from pathlib import Path

EXIT_DIFFERS = 1  # verify: the split is not the model


def register(sub) -> None:
    parser = sub.add_parser("split", help="a model split by a job file: check it against the unsplit model, measure it")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("verify", help="one training step split and unsplit in one process: loss_diff, "
                                          "max_rel_grad_diff, parameters (exit 1 if they differ)")
    p.add_argument("--job", type=Path, required=True, help="the job file (or a shipped job's name)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_verify)
    p = actions.add_parser("run", help="every site of the job on this host (a gateway per site, CURVE, each stage "
                                       "its own process), trained to its end; prints part 0's evaluation")
    p.add_argument("--job", type=Path, required=True, help="the job file (or a shipped job's name)")
    p.add_argument("--workdir", type=Path, default=Path("runs/split"), help="where the run goes (default runs/split)")
    p.add_argument("--steps", type=int, help="override [train].steps")
    p.set_defaults(func=_run)
    p = actions.add_parser("bench", help="the job across local sites (gateways, CURVE) per codec: peak memory "
                                         "and step time per stage, bytes per token each way")
    p.add_argument("--job", type=Path, required=True, help="the job file (or a shipped job's name)")
    p.add_argument("--codecs", default="none,bf16,int8", help="comma-separated codecs, each for both directions "
                   "of every link (default none,bf16,int8)")
    p.add_argument("--steps", type=int, default=3, help="steps per codec; the first is left out of the times")
    p.add_argument("--workdir", type=Path, default=Path("runs/split-bench"), help="where the runs go")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_bench)


def _verify(args) -> int:
    from nebula.runtime.job import load_job  # why here: torch, kept off `nebula --help`
    from nebula.shipped import job_file
    from services.split.verify import GRAD_TOLERANCE, LOSS_TOLERANCE, verify

    result = verify(load_job(job_file(args.job)))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else EXIT_DIFFERS
    for part in result["parts"]:
        print(f"{part['stage']:>12}: {part['parameters']:,} parameters; receives {', '.join(part['receives']) or '-'};"
              f" sends {', '.join(part['sends']) or '-'}")
    print(f"loss split {result['loss_split']:.7f} unsplit {result['loss_unsplit']:.7f}")
    print(f"loss_diff {result['loss_diff']:.3g} (tolerance {LOSS_TOLERANCE:g} x loss)")
    print(f"max_rel_grad_diff {result['max_rel_grad_diff']:.3g} at {result['worst_parameter']} "
          f"(tolerance {GRAD_TOLERANCE:g})")
    print(f"parameters {result['parameters']} ({result['elements']:,} values), each with its gradient compared")
    print("the split is the model" if result["ok"] else "the split DIFFERS from the model")
    return 0 if result["ok"] else EXIT_DIFFERS


def _run(args) -> int:
    from nebula.shipped import job_file  # why here: torch, kept off `nebula --help`
    from services.split.bench import run_here

    scores = run_here(job_file(args.job), args.workdir, args.steps)
    print(json.dumps(scores, indent=1))
    return 0


def _bench(args) -> int:
    from nebula.shipped import job_file  # why here: torch, kept off `nebula --help`
    from services.split.bench import print_table, run_bench

    result = run_bench(job_file(args.job), args.workdir, [c for c in args.codecs.split(",") if c], args.steps)
    print(json.dumps(result, indent=1) if args.json else print_table(result))
    return 0
