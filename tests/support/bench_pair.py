"""Two ways to run one job, measured one after the other in the same run on this host (the throughput benchmarks
of scripts/compose-check and scripts/slurm-check): the median step time of each, their ratio against a target,
and the load average beside each run, as the numbers mean little without it on a shared machine."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable


def measure(steps: int, candidate: tuple[str, Callable[[], float]], baseline: tuple[str, Callable[[], float]],
            target: float) -> dict:
    """The candidate's run first, then the baseline's; ratio = the candidate's steps/s over the baseline's."""
    loads = [os.getloadavg()[0]]
    candidate_s = candidate[1]()
    loads.append(os.getloadavg()[0])
    baseline_s = baseline[1]()
    loads.append(os.getloadavg()[0])
    return {"steps": steps, "cpus": os.cpu_count(), f"{baseline[0]}_step_s": baseline_s,
            f"{candidate[0]}_step_s": candidate_s, "ratio": baseline_s / candidate_s, "target": target,
            "load_1m": dict(zip(("before", "between", "after"), loads))}


def table(result: dict, rows: dict[str, str], ratio: str) -> str:
    """`rows`: result key (without _step_s) -> its label, the baseline first; `ratio`: what the ratio compares."""
    load = result["load_1m"]
    lines = [f"{'run':<16}{'median step s':>14}{'steps/s':>10}"]
    lines += [f"{label:<16}{result[f'{key}_step_s']:>14.3f}{1 / result[f'{key}_step_s']:>10.2f}"
              for key, label in rows.items()]
    lines += [f"ratio ({ratio} steps/s): {result['ratio']:.3f} (target >= {result['target']})",
              f"{result['steps']} steps each; {result['cpus']} CPUs; load average (1 min) before "
              f"{load['before']:.1f}, between {load['between']:.1f}, after {load['after']:.1f}"]
    return "\n".join(lines)


def main(doc: str, run: Callable[[int], dict], show: Callable[[dict], str]) -> int:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="steps of the tiny job in each run (default 24)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    result = run(args.steps)
    print(json.dumps(result) if args.json else show(result))
    return 0
