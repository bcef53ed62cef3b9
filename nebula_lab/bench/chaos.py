"""`nebula bench chaos`: a two-site job that loses services at random and still ends where an
undisturbed run of the same seed ends (issue 12, "Chaos run" and "WAN cut").

Kills (default). A seeded schedule (`plan`) of SIGKILLs, each aimed at one service of the job's
sites: either gateway, any stage, or one rank of a data-parallel stage (its supervisor then stops
and restarts all the stage's ranks, as torchrun does). Kill k fires once the coordinator (the job's
first stage) is at step `after_step` or later, `delay_s` after that: mid-step, during a resume
round, or while an earlier victim is still loading its model. A target that is not running (in
backoff) is waited for, so some kills land on a service that has just been started again. Only the
supervisor (nebula.site.supervisor, restarts with backoff) repairs anything.

WAN cut (`--cut S`, needs root). The same job with each site in its namespace of the emulated WAN
(nebula_lab.wanem); once the coordinator is at step `--cut-at`, the link loses every packet for S
seconds (WanLink.cut), then comes back. A cut shorter than the stages' `[channel] wan_timeout` is
ridden out by the running processes; a longer one stops the job with exit 3 (LinkDown), after which
the run starts the stages again (as an operator would, once the link is back), from their checkpoints.

Verdict, per run, against an undisturbed run of the same job and seed on loopback:
- ledgers: every stage applied steps 1..N once each, in order, on the examples the undisturbed run
  used (the example order; tests/e2e checks that against the order itself);
- loss: for every stage with a loss, |final loss - undisturbed final loss| <= noise, where noise is
  the standard deviation of the undisturbed run's step losses over its last quarter of steps (at
  least 4): how far the loss of one step moves on its own, i.e. how precisely one final loss
  measures the training at all. A resume restores weights, optimiser, RNG and codec state, so the
  curves should in fact be equal: the largest per-step difference is reported too.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from nebula.commands.demo import default_job
from nebula.errors import ConfigError, StageError
from nebula.runtime.records import read_records
from nebula.shipped import job_file
from nebula.site.supervisor import Supervisor
from nebula_lab.wanem import WanLink

if TYPE_CHECKING:  # why: the job loader imports torch, which `nebula --help` (it lists this module) must not pay
    from nebula.runtime.job import JobConfig

POLL_S = 0.05


@dataclass(frozen=True)
class Kill:
    after_step: int  # the coordinator is at this step (it goes back on a resume) or later...
    delay_s: float  # ...and this long has passed since it got there
    target: str  # a service ("gateway-a", "decoder") or one rank of a stage ("disc#1")


def register(sub) -> None:
    parser = sub.add_parser("chaos", help="a two-site job under seeded SIGKILLs of any service (or a WAN cut, "
                                          "root): ledgers exactly once, final loss vs an undisturbed run")
    parser.add_argument("--job", default=None,
                        help="job file or shipped job name (default: the one `nebula demo` runs; in a checkout "
                             "tests/e2e/jobs/tiny.toml runs in about a minute)")
    parser.add_argument("--seed", type=int, action="append",
                        help="schedule and [train].seed (repeatable: one run each; default 1)")
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs per run (default 10)")
    parser.add_argument("--steps", type=int, default=24, help="[train].steps of the run (default 24)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="[train].checkpoint_every (default 2)")
    parser.add_argument("--peer-timeout", type=float, default=None, metavar="S",
                        help="the stages' [channel] peer_timeout (default 30 s; a stage restarting on busy "
                             "cores may take longer, and its peers would then give up on it and restart too)")
    parser.add_argument("--cut", type=float, default=None, metavar="S",
                        help="instead of kills: cut the emulated WAN link for S seconds mid-job (root)")
    parser.add_argument("--cut-at", type=int, default=4, help="the coordinator's step when the link is cut")
    parser.add_argument("--wan-timeout", type=float, default=None, metavar="S",
                        help="the stages' [channel] wan_timeout (default: the site config's, 600 s)")
    parser.add_argument("--rate-mbit", type=float, default=60.0, help="emulated link rate for --cut")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per seed")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source = job_file(args.job or default_job())
    if args.kills < 0 or args.steps < 2 or args.checkpoint_every < 1:
        raise ConfigError("--kills must be >= 0, --steps >= 2 and --checkpoint-every >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="nebula-bench-chaos-") as tmp:
        work = (args.workdir or Path(tmp)).resolve()
        for seed in args.seed or [1]:
            where = work / f"seed-{seed}"
            job = prepare_job(source, where, steps=args.steps, checkpoint_every=args.checkpoint_every, seed=seed)
            if args.cut is not None:
                row = run_cut(job, where, args.cut, at_step=args.cut_at, wan_timeout=args.wan_timeout,
                              rate_mbit=args.rate_mbit)
            else:
                row = run_kills(job, where, seed, args.kills,
                                {"peer_timeout": args.peer_timeout} if args.peer_timeout else None)
            rows.append(row)
            if not args.json:
                print_row(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if all(row["ok"] for row in rows) else 1


def progress(line: str) -> None:
    print(f"[bench chaos] {line}", file=sys.stderr, flush=True)


# --- the job and its runs ---------------------------------------------------------------------------
def prepare_job(source: Path, work: Path, steps: int, checkpoint_every: int, seed: int) -> Path:
    """A copy of `source` with its data path made absolute and [train] steps, checkpoints and seed set."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import override, read_job_table, write_job_file

    path = work / "job.toml"
    write_job_file(path, override(read_job_table(source), train={"steps": steps, "checkpoint_every": checkpoint_every,
                                                                 "seed": seed}))
    return path


class JobRun:
    """A job's sites as supervised local processes (restarts with backoff), watched by the caller."""

    def __init__(self, run: Path, job_file: Path, wan: WanLink | None = None, channel: dict | None = None,
                 keys: bool = True, max_restarts: int = 5, restart: bool = True):
        # why here: torch, kept off `nebula --help`
        from nebula.runtime.job import load_job
        from nebula.site.local import start_sites

        self.run, self.job = run, load_job(job_file)
        self.stages = list(self.job.stages)
        self.coordinator = self.job.graph.coordinator
        self.group = start_sites(run, job_file, wan=wan, restart=restart, channel=channel, keys=keys)
        self.group.max_restarts = max_restarts
        self.started = time.monotonic()

    def step(self) -> int:
        """The coordinator's current step: its latest step record or resume (which may go back)."""
        return current_step(self.run / self.coordinator / "metrics.jsonl")

    def finished(self) -> bool:
        return all(self.group.services[name].finished() for name in self.stages)

    def supervise(self, until: Callable[[], bool], timeout: float, what: str,
                  each: Callable[[], None] | None = None) -> None:
        """Supervise (restarts; StageError when a service fails for good, or after `timeout`) until `until()`."""
        self.group.run(until, timeout=timeout, what=what, each=each, interval=POLL_S)

    def restarts(self) -> dict[str, int]:
        return {name: s.restarts for name, s in self.group.services.items()}

    def stop(self) -> None:
        self.group.stop()


def job_timeout(steps: int, kills: int = 0) -> float:
    return 300.0 + 20.0 * steps + 60.0 * kills  # generous: 2 shared cores, a model load per restart


def reference_run(job_file: Path, work: Path) -> Path:
    """The undisturbed run on loopback: nothing restarts (a failure ends the bench)."""
    run = work / "undisturbed"
    started = time.monotonic()
    job = JobRun(run, job_file, restart=False)
    try:
        job.supervise(job.finished, job_timeout(job.job.train.steps), "the undisturbed run to finish")
    finally:
        job.stop()
    progress(f"undisturbed run: {job.job.train.steps} steps in {time.monotonic() - started:.0f} s")
    return run


# --- kills -------------------------------------------------------------------------------------------
def targets(job: JobConfig) -> list[str]:
    """Every service of the job's sites: a gateway per site, each stage, and each rank of a stage of several."""
    services = [f"gateway-{site}" for site in job.sites]
    for name, stage in job.stages.items():
        services += [name] if stage.ranks == 1 else [f"{name}#{rank}" for rank in range(stage.ranks)]
    return services


def plan(seed: int, services: list[str], kills: int, steps: int) -> list[Kill]:
    """`kills` kills at seeded random points of the first three quarters of the job (the last quarter
    is left to finish in), each up to 1.5 s into its step or into what follows an earlier kill."""
    rng = random.Random(seed)
    last = max(0, steps * 3 // 4)
    points = sorted(rng.randint(0, last) for _ in range(kills))
    return [Kill(after_step=p, delay_s=round(rng.uniform(0.0, 1.5), 2), target=rng.choice(services)) for p in points]


def run_kills(job_file: Path, work: Path, seed: int, kills: int, channel: dict | None = None) -> dict:
    """The undisturbed run, then the run under `plan(seed, ...)`; the row of the table. `channel`:
    the stages' [channel] keys (e.g. a longer peer_timeout where a restart takes long)."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job

    reference = reference_run(job_file, work)
    job = load_job(job_file)
    schedule = plan(seed, targets(job), kills, job.train.steps)
    run = JobRun(work / "chaos", job_file, channel=channel, max_restarts=kills + 5)
    done: list[dict] = []
    pending = list(schedule)
    armed: list[float] = []  # when the next kill's step was reached

    def fire() -> None:
        if not pending:
            return
        if not armed and run.step() >= pending[0].after_step:
            armed.append(time.monotonic())
        if armed and time.monotonic() - armed[0] >= pending[0].delay_s:
            kill = pending[0]
            proc = target_process(run.group, kill.target)
            if proc is None:
                return  # in backoff or just exited: it is killed once it runs again
            at = run.step()
            os.killpg(proc.pid, signal.SIGKILL)
            done.append({**asdict(kill), "at_step": at, "at_s": round(time.monotonic() - run.started, 1)})
            progress(f"seed {seed}: kill {len(done)}/{kills}: {kill.target} at step {at}")
            pending.pop(0)
            armed.clear()
    try:
        run.supervise(run.finished, job_timeout(job.train.steps, kills), "the job under kills to finish", each=fire)
        wall = time.monotonic() - run.started
        restarts = run.restarts()
    finally:
        run.stop()
    row = {"mode": "kills", "seed": seed, "steps": job.train.steps, "kills_planned": kills, "kills": len(done),
           "restarts": sum(restarts.values()), "restarts_by_service": restarts, "wall_s": round(wall, 1),
           "schedule": done, "skipped": [asdict(k) for k in pending]}
    return judge(row, work / "chaos", reference, job)


def target_process(group: Supervisor, target: str) -> subprocess.Popen | None:
    """The running process of `target` ("name" or "name#rank"), or None when it is not running now."""
    name, _, rank = target.partition("#")
    service = group.services[name]
    if service.state != "running" or len(service.procs) <= int(rank or 0):
        return None
    proc = service.procs[int(rank or 0)]
    return proc if proc.poll() is None else None


# --- WAN cut -----------------------------------------------------------------------------------------
def run_cut(job_file: Path, work: Path, cut_s: float, at_step: int, wan_timeout: float | None = None,
            rate_mbit: float = 60.0) -> dict:
    """The undisturbed run, then the job on the emulated WAN with the link cut for `cut_s` s from
    the coordinator's step `at_step`; a job the cut stopped (exit 3) is started again once the link
    is back. Row: how it stopped (if it did), the time from the link's return to the next step."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job

    job = load_job(job_file)
    if not 0 <= at_step < job.train.steps:
        raise ConfigError(f"--cut-at {at_step}: the job has steps 1..{job.train.steps}; cut before the last")
    reference = reference_run(job_file, work)
    channel = {"wan_timeout": wan_timeout} if wan_timeout else None
    run_dir = work / "cut"
    with WanLink(f"nbchaos{os.getpid()}", rate_mbit=rate_mbit) as link:
        runs = [JobRun(run_dir, job_file, wan=link, channel=channel)]
        try:
            step_at_cut, stopped = cut_link(runs[0], link, at_step, cut_s)
            back, back_wall = time.monotonic(), time.time()
            if stopped is not None:  # as an operator would: start the stages again once the link is back
                runs[0].stop()
                runs.append(JobRun(run_dir, job_file, wan=link, channel=channel, keys=False))
            run = runs[-1]
            run.supervise(lambda: steps_since(run_dir / run.coordinator / "metrics.jsonl", back_wall) > 0
                          or run.finished(), job_timeout(1), "the first step after the cut")
            resume_s = time.monotonic() - back
            run.supervise(run.finished, job_timeout(job.train.steps), "the job to finish after the cut")
        finally:
            for each in runs:
                each.stop()
    restarts = {name: sum(r.restarts().get(name, 0) for r in runs) for name in runs[0].restarts()}
    row = {"mode": "cut", "seed": job.train.seed, "steps": job.train.steps, "cut_s": cut_s,
           "cut_at_step": step_at_cut, "wan_timeout_s": wan_timeout, "stopped": stopped,
           "resume_s": round(resume_s, 1), "restarts": sum(restarts.values()), "restarts_by_service": restarts,
           "resumed_from": resumed_steps(run_dir / run.coordinator / "metrics.jsonl"),
           "unreachable_refusals": refusals(run_dir, job.sites, "unreachable")}
    return judge(row, run_dir, reference, job)


def cut_link(run: JobRun, link: WanLink, at_step: int, cut_s: float) -> tuple[int, dict | None]:
    """Cut the link once the coordinator is at `at_step`, for `cut_s` s, supervising meanwhile; the
    step it was cut at, and how the job stopped if a stage gave up on the link (None: it did not)."""
    run.supervise(lambda: run.step() >= at_step, job_timeout(at_step), f"step {at_step}")
    step, stopped = run.step(), None
    link.cut()
    cut_at = time.monotonic()
    progress(f"link cut at step {step}, for {cut_s:g} s")
    try:
        run.supervise(lambda: time.monotonic() - cut_at >= cut_s, cut_s + 60, "the end of the cut")
    except StageError as exc:  # a stage gave up on the link (exit 3): the job stops
        stopped = stopped_job(run, exc, time.monotonic() - cut_at)
        progress(f"the job stopped {stopped['after_s']:.0f} s into the cut: {stopped['message']}")
        time.sleep(max(0.0, cut_s - (time.monotonic() - cut_at)))  # its stages are down: nothing to poll
    finally:
        link.restore()
    progress("link restored")
    return step, stopped


def stopped_job(run: JobRun, exc: StageError, after_s: float) -> dict:
    """Every stage's exit once the first stopped (each finds the outage on its own), and why."""
    for name in run.stages:
        for proc in run.group.services[name].procs:
            proc.wait(60)
    codes = {name: run.group.services[name].proc.returncode for name in run.stages}
    message = next((line for line in str(exc).splitlines() if "nebula: error:" in line), str(exc).splitlines()[0])
    return {"after_s": round(after_s, 1), "exit_codes": codes, "message": message.strip()}


# --- what the runs left --------------------------------------------------------------------------------
def current_step(metrics: Path) -> int:
    """The step of the latest step record or `resumed` event of a metrics file (0 before any)."""
    for record in reversed(read_records(metrics, None)):
        if record.get("kind") == "step" or record.get("event") == "resumed":
            return int(record["step"])
    return 0


def steps_since(metrics: Path, since: float) -> int:
    return sum(1 for r in read_records(metrics) if r["t"] >= since)


def resumed_steps(metrics: Path) -> list[int]:
    """The checkpoint steps of every resume after the first start (which resumes from step 0)."""
    return [r["step"] for r in read_records(metrics, "event") if r.get("event") == "resumed"][1:]


def step_losses(metrics: Path) -> dict[int, float]:
    """Step -> loss of a stage's metrics (a step run again after a resume: its last record)."""
    return {r["step"]: r["loss"] for r in read_records(metrics) if r.get("loss") is not None}


def refusals(run: Path, sites: list[str], code: str) -> dict[str, int]:
    """Per site: messages its gateway(s) refused with `code`, from their final counters (audit log)."""
    stopped = {site: [r for r in read_records(run / "audit" / f"{site}.jsonl", None)
                      if r.get("event") == "gateway.stopped"] for site in sites}
    return {site: sum(r["stats"].get("refused", {}).get(code, 0) for r in records) for site, records in stopped.items()}


def ledger(run: Path, stage: str) -> list:
    path = run / stage / "ledger.json"
    return json.loads(path.read_text())["steps"] if path.exists() else []


def judge(row: dict, run: Path, reference: Path, job: JobConfig) -> dict:
    """Add the ledger and loss verdicts (module docstring) to `row`."""
    steps = list(range(1, job.train.steps + 1))
    problems = []
    for name in job.stages:
        got, want = ledger(run, name), ledger(reference, name)
        if [s for s, _ in got] != steps:
            problems.append(f"{name} applied steps {[s for s, _ in got]}, not 1..{job.train.steps} once each")
        elif got != want:
            problems.append(f"{name} trained on other examples than the undisturbed run")
    row["ledgers_ok"] = not problems
    row["losses"] = {}
    for name in job.stages:
        ours, theirs = step_losses(run / name / "metrics.jsonl"), step_losses(reference / name / "metrics.jsonl")
        if not theirs:
            continue  # a stage without a loss of its own
        tail = [theirs[s] for s in steps[-max(4, len(steps) // 4):] if s in theirs]
        noise = statistics.stdev(tail) if len(tail) > 1 else 0.0
        final, base = ours.get(steps[-1]), theirs.get(steps[-1])
        diff = abs(final - base) if final is not None and base is not None else float("inf")
        row["losses"][name] = {"final": final, "undisturbed": base, "diff": diff, "noise": round(noise, 4),
                               "max_step_diff": max((abs(ours[s] - theirs[s]) for s in theirs if s in ours),
                                                    default=float("inf"))}
        if not diff <= noise:
            problems.append(f"{name}: final loss {final} vs undisturbed {base}: |diff| {diff:.4g} > noise {noise:.4g}")
    if row["mode"] == "kills" and row["kills"] != row["kills_planned"]:
        problems.append(f"only {row['kills']} of {row['kills_planned']} kills happened before the job ended")
    row["problems"], row["ok"] = problems, not problems
    return row


# --- output -------------------------------------------------------------------------------------------
def print_row(row: dict) -> None:
    losses = " ".join(f"{name} {v['final']:.4f} vs {v['undisturbed']:.4f} (|d| {v['diff']:.2g}, noise "
                      f"{v['noise']:.2g}; per step up to {v['max_step_diff']:.2g})"
                      for name, v in row["losses"].items() if v["final"] is not None)
    if row["mode"] == "kills":
        print(f"{'seed':>4} {'kills':>5} {'restarts':>8} {'steps':>5} {'wall s':>7}  final loss vs undisturbed")
        print(f"{row['seed']:>4} {row['kills']:>5} {row['restarts']:>8} {row['steps']:>5} {row['wall_s']:>7}  {losses}")
        for k in row["schedule"]:
            print(f"     kill at step {k['at_step']:>3} (+{k['delay_s']:.2f} s, {k['at_s']:>6.1f} s): {k['target']}")
    else:
        how = "rode it out" if row["stopped"] is None else \
            f"stopped after {row['stopped']['after_s']} s, started again ({row['stopped']['message']})"
        print(f"cut {row['cut_s']:g} s at step {row['cut_at_step']}: {how}; first step {row['resume_s']} s after the "
              f"link returned; restarts {row['restarts']}; resumed from {row['resumed_from'] or 'nothing'}; "
              f"refused as unreachable by the gateways: {row['unreachable_refusals']}")
        print(f"  final loss vs undisturbed: {losses}")
    print(f"  ledgers: {'every step once, as undisturbed' if row['ledgers_ok'] else 'WRONG'}; "
          f"{'ok' if row['ok'] else 'FAILED: ' + '; '.join(row['problems'])}", flush=True)
