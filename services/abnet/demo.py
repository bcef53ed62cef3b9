"""`nebula demo`: ABNet-Cloud es->en on two sites as local processes, CURVE on, end to end.

Prepares the corpus if missing, makes both sites' keys, starts two gateways and the two stages,
shows training progress, prints the cross-site BLEU and writes a PNG of the loss curve.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nebula.commands.demo import Demo, check_apart, check_run_dir, fresh_run_dir, job_copy, write_job
from nebula.errors import ConfigError, StageError
from nebula.runtime.records import read_records
from nebula.shipped import DEPLOY

DEFAULT_JOB = DEPLOY / "jobs" / "abnet-es-en.toml"  # shipped (nebula.shipped), in a checkout and installed
LONG_JOB = DEPLOY / "jobs" / "abnet-es-en-full.toml"  # the setting behind README's BLEU table


def _arguments(group) -> list:
    return [group.add_argument("--hot-start", type=Path, default=None, metavar="DIR",
                               help="continue from the checkpoints of a one-site run (nebula stage one-site)"),
            group.add_argument("--long", action="store_true",
                               help=f"the setting behind README's BLEU table ({LONG_JOB.name}: 2000 steps on every "
                                    "training pair, 500 test sentences), across two sites; docs/abnet.md says how "
                                    "long it takes")]


def demo(args) -> int:
    # why here: torch (the report reads the stages' helpers), kept off `nebula --help`
    from services.abnet import report

    if args.long and args.job is not None:
        raise ConfigError("--long runs the job abnet-es-en-full: leave out --job, or drop --long")
    scores = run_demo(LONG_JOB if args.long else args.job or DEFAULT_JOB, args.run_dir, args.steps, args.hot_start)
    run, raw = args.run_dir, scores.pop("job")
    forward = report.traffic(run / scores["source"] / "link.jsonl", "forward")
    backward = report.traffic(run / scores["sink"] / "link.jsonl", "backward")
    lines = report.summary_lines(scores, scores["steps"], scores["train_s"], scores["wall_s"], forward, backward)
    rows = report.examples(run, scores["source"], scores["sink"])
    print(f"\n{report.EXAMPLES} held-out sentences, evenly spaced over the {scores['n']} evaluated:\n")
    report.print_examples(rows)
    for line in lines:
        print(line)
    title = f"nebula demo: {raw['job']['name']} across two sites"
    out = report.write_report(run / "report.md", title, lines, rows, raw)
    print(f"report: {out}, loss curve: {run / 'loss.png'}; logs: {run / 'logs'}")
    return 0


# `nebula demo [abnet]` (nebula/commands/demo.py; named by the workload's spec, services/abnet/workload.py)
DEMO = Demo(summary="train ABNet-Cloud es->en across two local sites, print BLEU", run=demo, job=DEFAULT_JOB,
            add_arguments=_arguments, default=True)


def watch(group, run: Path, total: int, driver: str, sink: str) -> float:
    """A progress bar over the training steps, then a line while the sites evaluate; -> the
    monotonic time the last step was seen."""
    trained = None
    with tqdm(total=total, desc="training", unit="step") as bar:
        while not group.services[driver].finished():
            group.poll()
            steps = [r for r in read_records(run / sink / "metrics.jsonl") if "loss" in r]
            if steps and steps[-1]["step"] != bar.n:  # redraw only on progress (logs stay short)
                bar.set_postfix(loss=f"{steps[-1]['loss']:.3f}", refresh=False)
                bar.update(steps[-1]["step"] - bar.n)
            if bar.n >= total and trained is None:
                trained = time.monotonic()
                bar.close()
                print("translating the held-out sample across the sites (beam search) ...", flush=True)
            time.sleep(0.5)
    return trained or time.monotonic()


def codecs_label(job) -> str:
    last = job.links[0].compression.phases[-1]
    return f"{last.forward.codec.spec} forward, {last.backward.codec.spec} backward"


def check(job_file: Path, run: Path, steps: int | None, hot: Path | None) -> tuple[dict, Any]:
    """Every argument, before anything is written: the job (two stages at two sites), the hot-start
    checkpoints of each stage, the run directory. -> the job as a dict (for the run dir's copy), parsed."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import parse_job
    raw = job_copy(job_file, steps)
    job = parse_job(raw, job_file)
    if len(job.stages) != 2 or len(job.sites) != 2:
        raise ConfigError(f"{job_file}: the demo runs a job of two stages at two sites, this one has "
                          f"{list(job.stages)} at {job.sites}")
    if not job.data:
        raise ConfigError(f"{job_file}: [job].data is not set; the demo needs the directory of the corpus")
    if hot is not None:
        for name in job.stages:
            if not any((hot / name / "checkpoints").glob("step-*.pt")):
                raise ConfigError(f"--hot-start {hot}: no checkpoints in {hot / name / 'checkpoints'}; run "
                                  f"`nebula stage one-site --job JOB --workdir {hot}` first")
        check_apart(run, hot, "--hot-start")
    check_run_dir(run)
    return raw, job


def run_demo(job_file: Path, run: Path, steps: int | None, hot: Path | None = None) -> dict:
    # why here: torch, matplotlib and the corpus tooling, kept off `nebula --help`
    from nebula.observe.plots import metric_curve, plot_curves
    from nebula.site.local import hot_start, interrupted_by_sigterm, start_sites
    from services.corpus.prepare import ensure_prepared

    begun = time.monotonic()  # the whole demo, corpus preparation included
    raw, job = check(job_file, run, steps, hot)
    fresh_run_dir(run)
    driver, sink = job.graph.coordinator, job.graph.sinks[0]
    job_file = write_job(raw, run / "job.toml", job_file)
    ensure_prepared(Path(job.data), log=lambda line: print(f"nebula demo: {line}", flush=True))
    if hot:
        hot_start(run, hot, list(job.stages))
    started = time.monotonic()
    with interrupted_by_sigterm():
        group = start_sites(run, job_file)
        try:
            trained = watch(group, run, job.train.steps, driver, sink)
        finally:
            group.stop()
    scores_file = run / driver / "scores.json"
    if not scores_file.exists():
        raise StageError(f"the job ended without scores; see the logs in {run / 'logs'}")
    scores = json.loads(scores_file.read_text())
    plot_curves({codecs_label(job): metric_curve(run / sink / "metrics.jsonl")}, run / "loss.png",
                f"{job.name} across two sites", "training loss")
    scores.update(wall_s=round(time.monotonic() - begun, 1), train_s=round(trained - started, 1),
                  steps=job.train.steps, source=driver, sink=sink, job=raw)
    return scores
