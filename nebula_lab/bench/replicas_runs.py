"""The runs of the replicas bench (nebula_lab.bench.replicas has the method and the table).

- `curve`: one setting's validation loss every --eval-every steps. Nebula: the replicated job with every
  replica in one process (nebula.runtime.onesite: the same runtime, its stages joined by in-process
  channels), in parts that end on a round (each part resumes from the last one's checkpoints, and its last
  step is a round it would have made anyway), replica 0 scoring the validation loss after each. DDP: its
  ranks on loopback, rank 0 scoring in the loop. No root, deterministic on one machine.
- `speed`: the same job timed on the emulated WAN (root): Nebula's replicas as real services (a gateway
  per site, CURVE), DDP's ranks in the sites' namespaces; s_per_step over whole rounds, WAN bytes per step
  from the links' tbf counters, utilisation = compute time / wall time at replica (rank) 0.
- `killed`: the chosen setting on the emulated WAN with the last replica's stage SIGKILLed mid-round and
  restarted by its supervisor (a deadline of KILL_DEADLINE_S): how long the others' round after the kill
  waited and with whom, whether the victim averaged with them again, and every stage's steps, once.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

from nebula.errors import StageError
from nebula.runtime.records import read_records
from nebula_lab.bench.wan import progress

LEAD_IN = 2  # untimed steps of a DDP or H = 1 run (TCP slow start, the first all-reduce's connections)
KILL_DEADLINE_S = 5.0  # the kill run's: shorter than a restart (process, model, join), so the round goes on


def write(run: Path, raw: dict) -> Path:
    from nebula.runtime.job_file import write_job_file  # why here: torch, kept off `nebula --help`
    run.mkdir(parents=True, exist_ok=True)
    write_job_file(run / "job.toml", raw)
    return run / "job.toml"


def same_job(run: Path, raw: dict) -> bool:
    """Whether `run` holds the job `raw` as `write` would write it."""
    from nebula.runtime.job_file import job_text
    kept = run / "job.toml"
    return kept.exists() and kept.read_text() == job_text(raw, None)


def read_curve(path: Path) -> list[list[float]]:
    """[step, loss] of each evaluation in a valid.jsonl (the last of a step counts)."""
    points = {}
    for record in read_records(path, None) if path.exists() else []:
        points[record["step"]] = record["loss"]
    return [[step, loss] for step, loss in sorted(points.items())]


def last_evaluated(steps: int, every: int) -> int:
    """The last step a curve evaluates: the last multiple of `every` (a round) up to the job's steps."""
    return steps - steps % every if every else steps


def curve(run: Path, raw: dict, system: str, every: int, scenario: str) -> list[list[float]]:
    """One setting's validation curve; kept runs are not trained again."""
    stage = next(iter(raw["stages"]))
    found = run / ("rank0" if system == "ddp" else stage) / "valid.jsonl"
    steps = raw["train"]["steps"]
    kept = read_curve(found) if same_job(run, raw) else []  # a run of another job (another setting) is no cache
    if kept and kept[-1][0] >= last_evaluated(steps, every):
        return kept
    shutil.rmtree(run, ignore_errors=True)
    job_file = write(run, raw)
    started = time.monotonic()
    # a 500-step curve takes 15-85 min on 2 cores: say where it is (DDP's rank 0 logs each evaluation)
    progress(f"{run.name}: training {steps} steps" + (f", each evaluation in {run / 'rank0.log'}"
                                                      if system == "ddp" else ""))
    if system == "ddp":
        from nebula_lab.bench.ddp_peer import run_ranks
        # a hang guard, not a deadline: a curve shares the cores with whatever else runs (7 s a step at a load
        # of 20 here); a fixed hour killed six 500-step curves three quarters through
        run_ranks(run, job_file, scenario, len(raw["replicas"]["groups"]), steps, every, timeout_s=600 + 60 * steps)
    else:
        from nebula.runtime.job import load_job
        from nebula.runtime.onesite import run_one_site
        job = load_job(job_file)
        tenth = max(every, steps // 10)
        for until in range(every, steps + 1, every):
            run_one_site(job, run, quiet=True, until=until)
            points = read_curve(found)
            if until % tenth < every and until < steps and points:
                progress(f"{run.name}: step {until}/{steps}, validation loss {points[-1][1]:.4f} "
                         f"({time.monotonic() - started:.0f} s)")
    trained = read_curve(found)
    progress(f"{run.name}: {steps} steps in {time.monotonic() - started:.0f} s, final loss {trained[-1][1]:.4f}")
    return trained


def speed(run: Path, raw: dict, system: str, rate: float, rtt: float, scenario: str) -> dict:
    """Steady seconds per step, WAN bytes per step and utilisation of one setting on the emulated mesh."""
    from nebula_lab.wanem import WanLink
    sites = tuple(group[0] for group in raw["replicas"]["groups"])
    shutil.rmtree(run, ignore_errors=True)
    job_file = write(run, raw)
    steps = raw["train"]["steps"]
    with WanLink(name_prefix=f"nbr{os.getpid()}", rate_mbit=rate, sites=sites, rtt_ms=rtt) as link:
        before = sum(s["qdisc"]["bytes"] for s in link.status().values())
        if system == "ddp":
            from nebula_lab.bench.ddp_peer import run_ranks
            run_ranks(run, job_file, scenario, len(sites), steps, 0, link=link, timeout_s=600 + 60 * steps)
        else:
            supervise(run, job_file, link, timeout_s=600 + 30 * steps)
        sent = sum(s["qdisc"]["bytes"] for s in link.status().values()) - before
    if system == "ddp":
        records = read_records(run / "rank0" / "steps.jsonl", None)
        timed = records[LEAD_IN:]
        wall = sum(r["step_s"] for r in timed)
    else:
        stage = next(iter(raw["stages"]))
        records = read_records(run / stage / "metrics.jsonl", "step")
        lead = raw["replicas"]["H"] if raw["replicas"]["H"] > 1 else LEAD_IN  # whole rounds after the first
        timed = [r for r in records if r["step"] > lead]
        wall = timed[-1]["t"] - next(r["t"] for r in records if r["step"] == lead)
    return {"s_per_step": round(wall / len(timed), 4), "wan_bytes_per_step": round(sent / steps),
            "utilisation": round(sum(r["compute_s"] for r in timed) / wall, 3),
            "compute_s": round(statistics.fmean(r["compute_s"] for r in timed), 4)}


def supervise(run: Path, job_file: Path, link, timeout_s: float, kill=None) -> dict:
    """Every site's services until every instance (every replica's stages) finished; `kill(group)` is called
    every half second (a fault to inject). -> the supervisor's services."""
    from nebula.runtime.job import load_job
    from nebula.site.local import start_sites
    names = list(load_job(job_file).instances())
    group = start_sites(run, job_file, wan=link, restart=kill is not None)
    started = time.monotonic()
    try:
        while not all(group.services[n].finished() for n in names):
            group.poll()  # raises StageError, with the log tail, if anything failed for good
            if time.monotonic() - started > timeout_s:
                raise StageError(f"the replicas did not finish in {timeout_s:.0f} s; logs in {run / 'logs'}")
            if kill is not None:
                kill(group)
            time.sleep(0.5)
        return dict(group.services)
    finally:
        group.stop()


def killed(run: Path, raw: dict, rate: float, rtt: float) -> dict:
    """The last replica's stage SIGKILLed half-way through the second round; what the others did."""
    from nebula_lab.wanem import WanLink
    shutil.rmtree(run, ignore_errors=True)
    raw["replicas"]["deadline_s"] = KILL_DEADLINE_S
    job_file = write(run, raw)
    H, stage = raw["replicas"]["H"], next(iter(raw["stages"]))
    count = len(raw["replicas"]["groups"])
    victim = f"{stage}-r{count - 1}"
    done: list[int] = []

    def kill(group) -> None:
        steps = read_records(run / victim / "metrics.jsonl", "step")
        if not done and steps and steps[-1]["step"] >= H + H // 2:
            done.append(steps[-1]["step"])
            progress(f"killing {victim} at its step {done[0]}")
            group.kill(victim)
    sites = tuple(group[0] for group in raw["replicas"]["groups"])
    with WanLink(name_prefix=f"nbk{os.getpid()}", rate_mbit=rate, sites=sites, rtt_ms=rtt) as link:
        services = supervise(run, job_file, link, timeout_s=600 + 30 * raw["train"]["steps"], kill=kill)
    rounds = [r for r in read_records(run / stage / "metrics.jsonl", None) if r.get("event") == "outer"]
    after = next(r for r in rounds if r["step"] >= 2 * H)  # the round the kill landed in
    steps = list(range(1, raw["train"]["steps"] + 1))
    once = all([s for s, _ in json.loads((run / n / "ledger.json").read_text())["steps"]] == steps
               for n in services if not n.startswith("gateway"))
    return {"killed_at": done[0] if done else None, "round_step": after["step"], "contributors": after["contributors"],
            "wait_s": after["wait_s"], "deadline_s": KILL_DEADLINE_S, "each_step_once": once,
            "rejoined": any(r["contributors"] == list(range(count)) for r in rounds if r["step"] > after["step"]),
            "restarts": services[victim].restarts}
