"""`nebula bench wan --time-to-loss TARGET`: T = steps to a target validation loss x steady step time.

The metric of the ProtocolNanoGPT speedrun: compression that makes steps faster but needs more of them
is charged for it. Two measurements per setting (a scenario's TimeToLoss hooks say what a setting is:
codecs on every link, a schedule, options set on every stage such as an architecture):

- **steps**: the setting trains from the same initialisation (per seed) on one site (the stages in one
  process, joined by in-process channels that run the same codecs and schedule), in parts of
  --eval-every steps; after each part the job's first stage scores the validation loss through the
  stages (nebula.runtime.onesite; each part resumes from the last one's checkpoint, which a resumed
  job equals an uninterrupted one for). Steps = the first evaluated step at or below TARGET; a setting
  still above it at --max-steps is "not reached". How many steps a setting needs does not depend on
  the link, so this part needs no root.
- **step_s**: the steady step time of the same job as real services on a chain of emulated WAN links
  (nebula_lab.bench.wan.measure_rate: one run per rate and group of settings that share stage options
  and a schedule, one phase per codec setting, the first steps of each phase untimed). Rates: 200 Mbit/s
  with 50 ms RTT (ProtocolNanoGPT's links), then the communication-bound rate calibrated from that run's
  first (dense) setting, so that its wire time per step is --bound-factor (5) x the busiest stage's
  compute, as the ABNet bench does.

T_s = steps (mean over seeds) x step_s; T_vs_dense = T_s / the first setting's T_s at the same rate (< 1:
faster). Bytes per token each way: the codecs' payload bytes per training token on a link (mean over
the links and steps of the one-site runs, the runtime's example ids included).

`auto` (compression = "auto" on every link) is not trained one-site: on in-process links it has no
goodput to measure and stays on its first, lossless rung, so its convergence there says nothing of the
rung it takes on a slow link. It is timed alone on the chain (its run's first phase, with wan_auto's
lead so that its decisions have settled), and its steps are those of the trained setting that uses
the rung it chose on that link (e.g. `dense fp32` for `none`); where it chose a rung no setting
trained with, or more than one, its steps are not measured and its row says so (`steps_from`).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
from pathlib import Path

import tomllib

from nebula.errors import ConfigError
from nebula.runtime.records import read_records
from nebula_lab.bench.scenarios import TimeToLoss, kind_of, load_scenario
from nebula_lab.bench.seeds import t_interval
from nebula_lab.bench.wan import _workdir, bound_rate, holds_toml, measure_rate, progress
from nebula_lab.bench.wan_auto import AUTO_LEAD, WARM_UP, chosen

PNG_MBIT, PNG_RTT_MS = 200.0, 50.0  # ProtocolNanoGPT's simulated links
TIMED = 10  # timed steps per phase of a speed run (quick: 2)


def run_time_to_loss(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    if kind_of(scenario) is not TimeToLoss:
        raise ConfigError(f"--time-to-loss: the scenario {args.scenario} has no time-to-loss hooks "
                          "(nebula_lab.bench.scenarios.TimeToLoss)")
    if args.time_to_loss is None:
        raise ConfigError(f"the scenario {args.scenario} measures the time to a target loss: give "
                          "--time-to-loss TARGET (a validation loss; docs/gpt.md suggests one)")
    raw = base_raw(args, scenario)
    settings = chosen_settings(args, scenario)
    seeds = args.seeds or [raw["train"]["seed"]]
    budget = args.max_steps or raw["train"]["steps"]
    with _workdir(args.workdir) as work:
        quality = {(s["name"], seed): train_to_target(work / "steps" / f"seed{seed}" / slug(s["name"]),
                                                      setting_job(raw, s, seed, budget, args.eval_every),
                                                      args.time_to_loss, args.eval_every, scenario)
                   for seed in seeds for s in settings if seed in seeds_of(s, seeds) and not is_auto(s)}
        wan = os.geteuid() == 0 and not args.steps_only
        speed = measure_speed(args, work, raw, settings, scenario) if wan else {}
        if not wan:
            progress("step times skipped (--steps-only, or not root: the emulated WAN needs it)")
        rows = combine(settings, seeds, quality, speed, args.time_to_loss)
        if args.workdir:
            (work / "rows.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


def base_raw(args: argparse.Namespace, scenario) -> dict:
    """The scenario's job table for time-to-loss runs, its data path absolute, --seed and
    --micro-batches applied."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job
    job_file = args.job or scenario.job
    raw = tomllib.loads(Path(job_file).read_text())
    data = load_job(job_file).data
    if data:
        raw["job"]["data"] = data
    raw = scenario.ttl_job(raw, args.quick)
    if getattr(args, "seed", None) is not None:
        raw["train"]["seed"] = args.seed
    if getattr(args, "micro_batches", None):  # several: the pipeline bench's, one run each
        raw["train"]["micro_batches"] = args.micro_batches[0]
    return raw


def chosen_settings(args: argparse.Namespace, scenario) -> list[dict]:
    """The scenario's settings, or --setting FORWARD BACKWARD pairs (codecs on every link, the job's model)."""
    if not args.setting:
        return scenario.ttl_settings(args.quick)
    return [{"name": f"{f} / {b}", "forward": f, "backward": b, "schedule": None, "stages": {}}
            for f, b in args.setting]


def seeds_of(setting: dict, seeds: list[int]) -> list[int]:
    """The seeds a setting trains with: all of --seeds, or its first `seeds` (a scenario's ablations)."""
    return seeds[:setting.get("seeds") or len(seeds)]


def is_auto(setting: dict) -> bool:
    """A setting whose codecs `auto` picks on the link: timed on the chain, its steps borrowed."""
    return "auto" in (setting["forward"], setting["backward"])


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def setting_job(raw: dict, setting: dict, seed: int, steps: int, every: int) -> dict:
    """The job of one setting: its stage options, schedule and codecs (on every link), `steps` steps."""
    job = copy.deepcopy(raw)
    job["train"].update(seed=seed, steps=steps, checkpoint_every=every, log_every=every)
    for stage in job["stages"].values():
        stage.update(setting.get("stages", {}))
    if setting.get("schedule"):
        job.setdefault("schedule", {})["name"] = setting["schedule"]
    for link in job.get("links", []):
        link["compression"] = {"forward": setting["forward"], "backward": setting["backward"]}
    return job


# --- steps to the target (one site) ---------------------------------------------------------------------
def train_to_target(run: Path, job: dict, target: float, every: int, scenario) -> dict:
    """Train `job` in parts of `every` steps until an evaluation is at or below `target`, or to its last
    step; a run already finished for the same job in `run` is kept."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import write_job_file
    from nebula.runtime.onesite import run_one_site

    done = run / "row.json"
    if done.exists() and holds_toml(run / "job.toml", job):
        kept = json.loads(done.read_text())
        if any(loss <= target for _, loss in kept["curve"]) or kept["curve"][-1][0] >= job["train"]["steps"]:
            progress(f"kept {run} (delete it to train again)")
            return {**kept, **verdict(kept["curve"], target, job["train"]["steps"])}
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    loaded, steps = write_job_file(run / "job.toml", job), job["train"]["steps"]
    curve: list = []
    for until in range(every, steps + every, every):
        run_one_site(loaded, run, quiet=True, until=min(until, steps))
        curve = scenario.eval_curve(run, job)
        progress(f"{run.parent.name}/{run.name}: step {curve[-1][0]:.0f}, validation loss {curve[-1][1]:.4f}")
        if curve[-1][1] <= target:
            break
    row = {"curve": curve, **bytes_per_token(run, job)}
    done.write_text(json.dumps(row))
    return {**row, **verdict(curve, target, steps)}


def verdict(curve: list, target: float, budget: int) -> dict:
    """Steps to `target`: the first evaluation at or below it (else the budget, not reached)."""
    reached = next((step for step, loss in curve if loss <= target), None)
    return {"steps": reached if reached is not None else budget, "reached": reached is not None,
            "final_loss": next((loss for step, loss in curve if step == reached), curve[-1][1]), "target": target}


def bytes_per_token(run: Path, job: dict) -> dict:
    """Mean payload bytes per training token over every link and step, each direction."""
    per: dict[str, list[float]] = {"forward": [], "backward": []}
    for name in job["stages"]:
        for record in read_records(run / name / "metrics.jsonl"):
            for key, value in record.get("bytes_per_token", {}).items():
                per[key.rsplit(":", 1)[1]].append(value)
    return {f"bytes_per_token_{'fwd' if d == 'forward' else 'bwd'}": round(statistics.fmean(v), 3) if v else None
            for d, v in per.items()}


# --- step times (the emulated WAN, root) -----------------------------------------------------------------
def groups(settings: list[dict]) -> list[list[dict]]:
    """Settings that can share one speed run: the same stage options, schedule and micro-batches (one phase each)."""
    out: dict[str, list[dict]] = {}
    for s in settings:
        # `auto` runs alone: only a run's first phase gets the lead its decisions need
        key = [s.get("stages", {}), s.get("schedule"), s.get("speed", {}), s["name"] if is_auto(s) else None]
        out.setdefault(json.dumps(key, sort_keys=True), []).append(s)
    return list(out.values())


def speed_job(args: argparse.Namespace, raw: dict, group: list[dict], work: Path, scenario) -> dict:
    """One run of `group`: a phase per setting on every link (1 untimed + TIMED steps; the first phase 2
    more, nebula_lab.bench.wan.LEAD_IN), the last phase one more (the final checkpoint). A setting's
    `speed` (e.g. {"schedule": "1f1b", "micro_batches": 16}) applies to its timing only: schedules of the
    same weights and micro-batch counts change the order of work and the float order of a gradient's
    sum, not what is trained."""
    from nebula_lab.bench.wan import LEAD_IN
    timed = args.steps or (2 if args.quick else TIMED)
    lead = AUTO_LEAD + WARM_UP if is_auto(group[0]) else 0
    total = (1 + timed) * len(group) + LEAD_IN + lead + 1
    job = setting_job(raw, group[0], raw["train"]["seed"], total, total)
    speed = group[0].get("speed", {})
    if speed.get("schedule"):
        job.setdefault("schedule", {})["name"] = speed["schedule"]
    if speed.get("micro_batches"):
        job["train"]["micro_batches"] = speed["micro_batches"]
    job = scenario.speed_job(job, work, total)
    phases = [{"steps": 1 + timed, "forward": s["forward"], "backward": s["backward"]} for s in group]
    phases[0]["steps"] += LEAD_IN + lead
    phases[-1]["steps"] += 1
    for link in job["links"]:
        link["compression"] = {"phases": phases}
    first = job["links"][0]
    job["bench"] = {"link": f"{first['from']}->{first['to']}", "scenario": args.scenario, "first_lead": lead}
    return job


def measure_speed(args: argparse.Namespace, work: Path, raw: dict, settings: list[dict], scenario) -> dict:
    """(setting name, rate label) -> its speed row, at 200 Mbit/s + 50 ms RTT and at each communication-bound
    rate (--bound-factors), every run repeated --rounds times in alternating order; a row holds the mean
    step time over its rounds, their spread and the load each ran under."""
    rounds: dict = {}
    rates: list[tuple[str, float, float]] = [("png", PNG_MBIT, PNG_RTT_MS)]
    for round_ in range(1, (args.rounds or 1) + 1):
        for label, mbit, rtt in rates:  # the bound rates join the first round as soon as png calibrated them
            for i, group in enumerate(groups(settings)):
                run = work / "speed" / f"round{round_}" / f"{label}-{i}"
                job = speed_job(args, raw, group, work, scenario)
                load = os.getloadavg()[0]
                rows = measure_rate(run, job, mbit, rtt)
                if is_auto(group[0]):  # the codecs it used in its timed steps, on the first link
                    rows[0]["chosen"] = chosen(run, job, [0])
                for setting, row in zip(group, rows):
                    rounds.setdefault((setting["name"], label), []).append({**row, "rtt_ms": rtt, "load": load})
            if label == "png" and len(rates) == 1:  # calibrated from the first round's dense run
                first = rounds[(settings[0]["name"], "png")][0]
                for factor in args.bound_factors or [args.bound_factor]:
                    rate = bound_rate(first, factor)
                    rates.append((f"{factor:g}x", rate, args.rtt_ms or 0.0))
                    progress(f"communication-bound rate {factor:g}x: {rate} Mbit/s (the dense setting's wire = "
                             f"{factor:g} x its busiest stage's compute)")
    return {key: pooled(found) for key, found in rounds.items()}


def pooled(found: list[dict]) -> dict:
    """One setting's speed rows of every round -> the first with the mean step time, the rounds' times and loads."""
    steps = [r["s_per_step"] for r in found]
    limits = [r["limit_s"] for r in found if r.get("limit_s") is not None]
    return {**found[0], "s_per_step": round(statistics.fmean(steps), 3), "round_steps": steps,
            "loads": [round(r["load"], 2) for r in found],
            "limit_s": round(statistics.fmean(limits), 3) if limits else None}


# --- the table ------------------------------------------------------------------------------------------------
def combine(settings: list[dict], seeds: list[int], quality: dict, speed: dict, target: float) -> list[dict]:
    """A row per setting and rate: steps (mean over seeds, with a t interval over seeds), step time, T and
    T / dense (the first setting), the latter per seed (the same seeds) with its t interval."""
    rows = []
    labels = list(dict.fromkeys(label for _, label in speed)) if speed else ["none"]
    for label in labels:
        dense = None
        for s in settings:
            fast = speed.get((s["name"], label))
            source = steps_source(s, settings, fast)
            used = seeds_of(source, seeds) if source else []
            runs = {seed: quality[(source["name"], seed)] for seed in used}
            reached = all(r["reached"] for r in runs.values()) if runs else None
            steps = statistics.fmean(r["steps"] for r in runs.values()) if runs else None
            step_s = fast["s_per_step"] if fast else None
            T = round(steps * step_s, 1) if steps is not None and step_s is not None and reached else None
            if s is settings[0]:
                dense = {"T": T, "step_s": step_s, "runs": runs}
            ratios = [runs[seed]["steps"] * step_s / (dense["runs"][seed]["steps"] * dense["step_s"])
                      for seed in runs if T and dense["T"] and seed in dense["runs"]]
            rows.append({
                "setting": s["name"], "forward": s["forward"], "backward": s["backward"],
                "schedule": (s.get("speed") or {}).get("schedule") or s.get("schedule"),
                "micro_batches": (s.get("speed") or {}).get("micro_batches"), "stages": s.get("stages", {}),
                "rate": label, "link_mbit": fast["link_mbit"] if fast else None,
                "rtt_ms": fast["rtt_ms"] if fast else None,
                "steps": round(steps, 1) if steps is not None else None,
                "steps_interval": _rounded(t_interval([r["steps"] for r in runs.values()])),
                "steps_per_seed": [r["steps"] for r in runs.values()], "seeds": used,
                "steps_from": source["name"] if source else None, "chosen": (fast or {}).get("chosen"),
                "step_s": step_s, "round_steps": (fast or {}).get("round_steps"), "loads": (fast or {}).get("loads"),
                "limit_s": (fast or {}).get("limit_s"),
                "of_limit": round(fast["limit_s"] / step_s, 3) if fast and fast.get("limit_s") else None,
                "T_s": T, "T_vs_dense": round(T / dense["T"], 3) if T and dense["T"] else None,
                "T_vs_dense_per_seed": [round(r, 3) for r in ratios],
                "T_vs_dense_interval": _rounded(t_interval(ratios)),
                "bytes_per_token_fwd": _mean([r["bytes_per_token_fwd"] for r in runs.values()]),
                "bytes_per_token_bwd": _mean([r["bytes_per_token_bwd"] or 0 for r in runs.values()]),
                "target": target, "reached": reached,
                "final_loss": [round(r["final_loss"], 4) for r in runs.values()],
                "compute_s": busiest_compute(fast),
                "wire_s": fast["wire_s"] if fast else None})
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _rounded(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None or any(math.isnan(v) for v in interval) else [round(v, 3) for v in interval]


def steps_source(setting: dict, settings: list[dict], fast: dict | None) -> dict | None:
    """The setting whose trained runs give `setting`'s steps: itself, or for `auto` the setting trained
    with the one rung per direction it chose on this link (None: not timed, or no such setting)."""
    if not is_auto(setting):
        return setting
    picked = (fast or {}).get("chosen") or {}
    rung = {d: picked.get(d, [setting[d]]) for d in ("forward", "backward")}
    if any(len(codecs) != 1 for codecs in rung.values()):
        return None
    same = [*rung["forward"], *rung["backward"], setting.get("stages", {}), setting.get("schedule")]
    return next((s for s in settings if not is_auto(s)
                 and [s["forward"], s["backward"], s.get("stages", {}), s.get("schedule")] == same), None)


def busiest_compute(fast: dict | None) -> float | None:
    """The busiest stage's compute per step of a speed row (None: not timed)."""
    return max((v for k, v in fast.items() if k.startswith("compute_")), default=None) if fast else None


def table(rows: list[dict]) -> str:
    cols = [("setting", "setting", 34, "s"), ("rate", "rate", 5, "s"), ("Mbit/s", "link_mbit", 8, ".3g"),
            ("steps", "steps", 7, ".0f"), ("step_s", "step_s", 7, ".2f"), ("limit", "limit_s", 6, ".2f"),
            ("T_s", "T_s", 8, ".0f"), ("T/dense", "T_vs_dense", 8, ".3f"),
            ("B/tok fwd", "bytes_per_token_fwd", 10, ".1f"), ("B/tok bwd", "bytes_per_token_bwd", 10, ".1f"),
            ("reached", "reached", 8, "s"), ("comp", "compute_s", 6, ".2f"), ("wire", "wire_s", 6, ".2f")]
    lines = [" ".join(f"{t:<{w}}" if f == "s" else f"{t:>{w}}" for t, _, w, f in cols)]
    for row in rows:
        cells = []
        for _, key, w, f in cols:
            value = row[key]
            cells.append(f"{'-':>{w}}" if value is None else f"{str(value):<{w}}" if f == "s" else f"{value:>{w}{f}}")
        borrowed = f" (chose {row['chosen']}: steps of {row['steps_from']})" if row["chosen"] is not None else ""
        spread = f"; rounds {row['round_steps']} at load {row['loads']}" if row["round_steps"] else ""
        interval = f", 95% t {row['steps_interval']}" if row["steps_interval"] else ""
        ratio = f"; T/dense 95% t {row['T_vs_dense_interval']}" if row["T_vs_dense_interval"] else ""
        lines.append(" ".join(cells) + f"  seeds {row['seeds']}: steps {row['steps_per_seed']}{interval}{ratio}"
                     f"{spread}{borrowed}")
    lines.append(f"(target validation loss {rows[0]['target']}; T_s = steps x step_s; T/dense: T_s / the first "
                 "setting's at the same rate, and per seed with its t interval over seeds; limit: the busiest "
                 "resource per step plus one fill; B/tok: payload bytes per token on a link, each way)")
    return "\n".join(lines)
