"""`nebula bench wan --scenario gpt --peer torch`: the pipeline's step time against its limit and against the
peer a user would run instead, torch.distributed.pipelining, on the same chain of emulated links, in one run.

Every run is the scenario's job at its time-to-loss size (nebula_lab.bench.wan_ttl), one torch thread per
stage, on a mesh of emulated sites (nebula_lab.wanem): Nebula as real services (a gateway per site,
CURVE, its schedules `--schedules`), torch.distributed.pipelining as one gloo process per site over the
same links (`ScheduleGPipe`, `Schedule1F1B`: nebula_lab.bench.torch_peer), each at every micro-batch count
of `--micro-batches`. Rates: the communication-bound ones, `--bound-factors` x (the wire of one link
direction = factor x the busiest stage's compute, calibrated at the start of the run from Nebula's first
setting, as the time-to-loss bench does), and with `--png` 200 Mbit/s at 50 ms RTT. `--rounds` repeats
the whole list, alternating systems and schedules, so that drift in the machine's speed reaches every
row alike; a row reports the mean over rounds and the spread.

Each row carries its limit (nebula_lab.bench.limit): the busiest resource of a step plus one fill, from
what the Nebula run of the same setting and micro-batch count measured (each stage's compute, each link
direction's bytes at the rate, the RTT); torch's rows take the limit of the Nebula rows they match (the
same model, bytes and links). `of_limit` = limit / step: the fraction of the ideal a row reaches.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path

from nebula.errors import ConfigError
from nebula.runtime.records import read_records
from nebula_lab.bench.scenarios import TorchPeer, hooks, load_scenario
from nebula_lab.bench.wan import LEAD_IN, _workdir, bound_rate, measure_rate, progress
from nebula_lab.bench.wan_ttl import PNG_MBIT, PNG_RTT_MS, base_raw, speed_job

NEBULA_SCHEDULES = ("synchronous", "gpipe", "1f1b")
TORCH_SCHEDULES = ("gpipe", "1f1b")
BOUNDARY = {"none": "fp32", "bf16": "bf16"}  # a dense setting's codec -> what torch sends in its place
TIMED = 10


def run_pipeline(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    missing = [hook for hook in hooks(TorchPeer) if not hasattr(scenario, hook)]
    if missing:
        raise ConfigError(f"--peer torch: the scenario {args.scenario} lacks {', '.join(missing)} "
                          "(nebula_lab.bench.scenarios.TorchPeer)")
    settings = [tuple(pair) for pair in (args.setting or [("bf16", "bf16")])]
    for forward, backward in settings:
        if forward != backward or forward not in BOUNDARY:
            raise ConfigError(f"--peer torch: --setting {forward} {backward}: torch sends a dense tensor; compare "
                              f"dense settings, the same both ways ({', '.join(BOUNDARY)})")
    raw = base_raw(args, scenario)
    for stage in raw["stages"].values():
        stage["threads"] = 1  # four stages on one host: one thread each, in both systems
    plan = Plan(args, raw, settings)
    with _workdir(args.workdir) as work:
        calibration = plan.nebula(work / "calibrate", "synchronous", plan.micro[0], PNG_MBIT, PNG_RTT_MS)[0]
        rates = [(bound_rate(calibration, f), 0.0, f"{f:g}x") for f in args.bound_factors or [5.0]]
        progress("communication-bound rates: " + ", ".join(f"{label} {r} Mbit/s" for r, _, label in rates))
        if args.png:
            rates.append((PNG_MBIT, PNG_RTT_MS, "png"))
        rows = []
        for round_ in range(1, (args.rounds or 2) + 1):
            for rate, rtt, label in rates:
                for m in plan.micro:
                    for schedule in plan.schedules:
                        run = work / f"r{round_}" / label / f"nebula-{schedule}-m{m}"
                        found = plan.nebula(run, schedule, m, rate, rtt)
                        rows += [dict(r, round=round_, rate_label=label) for r in found]
                    for schedule in TORCH_SCHEDULES:
                        for setting in settings:
                            run = work / f"r{round_}" / label / f"torch-{schedule}-{setting[0]}-m{m}"
                            rows.append(dict(plan.torch(run, schedule, setting, m, rate, rtt), round=round_,
                                             rate_label=label))
        table_rows = combine(rows)
        if args.workdir:
            (work / "rows.json").write_text(json.dumps(table_rows, indent=1))
    print(json.dumps(table_rows, indent=1) if args.json else table(table_rows))
    return 0


class Plan:
    """The bench's runs: a Nebula run (every setting a phase) or a torch run, at one schedule, micro-batch
    count and rate."""

    def __init__(self, args: argparse.Namespace, raw: dict, settings: list[tuple[str, str]]):
        self.args, self.raw, self.settings = args, raw, settings
        self.micro = args.micro_batches or [4, 8, 16]
        self.schedules = args.schedules or list(NEBULA_SCHEDULES)
        self.timed = args.steps or TIMED
        batch = raw["train"]["batch_size"]
        if any(batch % m for m in self.micro):
            raise ConfigError(f"--micro-batches {self.micro}: each must divide the batch of {batch}")

    def job(self, schedule: str, m: int) -> dict:
        raw = copy.deepcopy(self.raw)
        raw["train"]["micro_batches"] = m
        raw.setdefault("schedule", {})["name"] = schedule
        return raw

    def nebula(self, run: Path, schedule: str, m: int, rate: float, rtt: float) -> list[dict]:
        group = [{"name": f"{f} / {b}", "forward": f, "backward": b} for f, b in self.settings]
        speed_args = argparse.Namespace(steps=self.timed, quick=False, scenario=self.args.scenario)
        job = speed_job(speed_args, self.job(schedule, m), group, run.parent, load_scenario(self.args.scenario))
        load = os.getloadavg()[0]
        rows = measure_rate(run, job, rate, rtt)
        peak = {name: max((r.get("peak_rss_mb", 0) for r in read_records(run / name / "metrics.jsonl", kind=None)
                           if r.get("event") == "finished"), default=None) for name in job["stages"]}
        return [{**r, "system": "nebula", "setting": r["forward"], "schedule": schedule, "micro_batches": m,
                 "rate_mbit": rate, "rtt_ms": rtt, "step_s": r["s_per_step"], "limit_s": r["limit_s"],
                 "busiest": r["busiest"], "wire_s": r["wire_s"], "load": round(load, 2), "peak_rss_mb": peak,
                 "stage_compute_s": {k[len("compute_"):-2]: v for k, v in r.items()
                                     if k.startswith("compute_") and k.endswith("_s")}}
                for r in rows]

    def torch(self, run: Path, schedule: str, setting: tuple[str, str], m: int, rate: float, rtt: float) -> dict:
        from nebula.runtime.job_file import write_job_file
        from nebula_lab.bench.torch_peer import add_routes, run_ranks
        from nebula_lab.wanem import WanLink

        job = self.job("synchronous", m)
        steps = 1 + LEAD_IN + self.timed
        job["train"].update(steps=steps, checkpoint_every=steps)
        scenario = load_scenario(self.args.scenario)
        job = scenario.speed_job(job, run, steps)
        run.mkdir(parents=True, exist_ok=True)
        job_file = run / "job.toml"
        write_job_file(job_file, job)
        sites = tuple(dict.fromkeys(stage["address"].split("/")[0] for stage in job["stages"].values()))
        progress(f"torch {schedule} {setting[0]} m={m}: {rate} Mbit/s{f', RTT {rtt:g} ms' if rtt else ''}")
        load = os.getloadavg()[0]
        with WanLink(name_prefix=f"nbt{os.getpid()}", rate_mbit=rate, sites=sites, rtt_ms=rtt) as link:
            add_routes(link)
            run_ranks(run, job_file, self.args.scenario, link, schedule, steps, BOUNDARY[setting[0]],
                      timeout_s=300 + 60 * steps)
        names = list(job["stages"])
        first = [json.loads(line) for line in (run / f"{names[0]}.jsonl").read_text().splitlines()]
        timed = [r for r in first if r["step"] > 1 + LEAD_IN]
        records = {name: [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
                   for name in names}
        cpu = {name: statistics.fmean(r["cpu_s"] for r in found[1 + LEAD_IN:]) for name, found in records.items()}
        peak = {name: found[-1]["peak_rss_mb"] for name, found in records.items()}
        return {"system": "torch", "setting": setting[0], "schedule": schedule, "micro_batches": m, "rate_mbit": rate,
                "rtt_ms": rtt, "step_s": round(statistics.fmean(r["step_s"] for r in timed), 3), "limit_s": None,
                "load": round(load, 2), "cpu_s": {k: round(v, 3) for k, v in cpu.items()}, "peak_rss_mb": peak}


def combine(rows: list[dict]) -> list[dict]:
    """One row per (system, setting, schedule, micro-batches, rate): the mean over rounds and its spread;
    torch's limit from the Nebula rows of the same setting, micro-batches and rate."""
    key = ("system", "setting", "schedule", "micro_batches", "rate_mbit")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in key), []).append(row)
    out = []
    for ident, group in groups.items():
        steps = [r["step_s"] for r in group]
        out.append({**dict(zip(key, ident)), "rtt_ms": group[0]["rtt_ms"], "rate_label": group[0]["rate_label"],
                    "step_s": round(statistics.fmean(steps), 3), "step_min_s": min(steps), "step_max_s": max(steps),
                    "rounds": len(group), "load": [r["load"] for r in group],
                    "limit_s": _mean([r["limit_s"] for r in group]), "busiest": group[0].get("busiest"),
                    **{k: group[0][k] for k in ("stage_compute_s", "cpu_s", "wire_s", "peak_rss_mb")
                       if k in group[0]}})
    for row in out:
        if row["limit_s"] is None:  # torch: the limit of the same resources, measured by Nebula's runs
            same = [r["limit_s"] for r in out if r["system"] == "nebula" and r["limit_s"] is not None
                    and all(r[k] == row[k] for k in ("setting", "micro_batches", "rate_mbit"))]
            row["limit_s"] = _mean(same)
        row["of_limit"] = round(row["limit_s"] / row["step_s"], 3) if row["limit_s"] else None
    return out


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 3) if present else None


def table(rows: list[dict]) -> str:
    cols = [("system", "system", 7, "s"), ("setting", "setting", 8, "s"), ("schedule", "schedule", 12, "s"),
            ("m", "micro_batches", 3, "d"), ("Mbit/s", "rate_mbit", 8, ".3g"), ("rtt", "rtt_ms", 5, ".0f"),
            ("step_s", "step_s", 7, ".2f"), ("min", "step_min_s", 6, ".2f"), ("max", "step_max_s", 6, ".2f"),
            ("limit_s", "limit_s", 8, ".2f"), ("of lim", "of_limit", 7, ".2f")]
    lines = [" ".join(f"{t:<{w}}" if f == "s" else f"{t:>{w}}" for t, _, w, f in cols) + "  busiest"]
    for row in sorted(rows, key=lambda r: (-r["rate_mbit"], r["micro_batches"], r["system"], r["schedule"])):
        cells = [f"{'-':>{w}}" if row[k] is None else f"{row[k]:<{w}}" if f == "s" else f"{row[k]:>{w}{f}}"
                 for _, k, w, f in cols]
        lines.append(" ".join(cells) + f"  {row.get('busiest') or ''}")
    lines.append("(step_s: mean over rounds, min/max their spread; limit: the busiest resource per step plus one "
                 "fill (nebula_lab.bench.limit), torch's from the Nebula runs of the same setting; of lim = limit / "
                 "step_s: the fraction of the ideal)")
    lines += verdicts(rows)
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    """Per rate: Nebula's best row against its limit and against torch's best."""
    out = []
    for rate in sorted({r["rate_mbit"] for r in rows}):
        at = [r for r in rows if r["rate_mbit"] == rate]
        mine = [r for r in at if r["system"] == "nebula"]
        peer = [r for r in at if r["system"] == "torch"]
        if not mine or not peer:
            continue
        best, theirs = min(mine, key=lambda r: r["step_s"]), min(peer, key=lambda r: r["step_s"])
        out.append(f"{rate:g} Mbit/s: Nebula's best {best['schedule']} m={best['micro_batches']} "
                   f"{best['step_s']:.2f} s = {best['step_s'] / best['limit_s']:.2f}x its limit; "
                   f"torch's best {theirs['schedule']} "
                   f"m={theirs['micro_batches']} {theirs['step_s']:.2f} s; Nebula / torch = "
                   f"{best['step_s'] / theirs['step_s']:.2f}")
    return out
