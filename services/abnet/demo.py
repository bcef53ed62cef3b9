"""`nebula demo`: ABNet-Cloud es->en on two sites as local processes, CURVE on, end to end.

Prepares the corpus if missing, makes both sites' keys, starts two gateways and the two stages,
shows training progress, prints the cross-site BLEU and writes a PNG of the loss curve.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from nebula.errors import ConfigError, StageError
from services.demo import Demo

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JOB = ROOT / "deploy" / "jobs" / "abnet-es-en.toml"


def _arguments(group) -> list:
    return [group.add_argument("--hot-start", type=Path, default=None, metavar="DIR",
                               help="continue from the checkpoints of a one-site run (nebula stage one-site)")]


def demo(args) -> int:
    scores = run_demo(args.job or DEFAULT_JOB, args.run_dir, args.steps, args.hot_start)
    print(f"\ncross-site BLEU on {scores['n']} held-out test sentences: {scores['bleu']:.2f} "
          f"(sacrebleu, case-insensitive) in {scores['wall_s']:.0f} s")
    for hyp, ref in scores.get("samples", [])[:3]:
        print(f"  hyp: {hyp}\n  ref: {ref}")
    print(f"loss curve: {args.run_dir / 'loss.png'}; logs: {args.run_dir / 'logs'}")
    return 0


# `nebula demo [abnet]` (services/demo.py; the entry-point group nebula.demos)
DEMO = Demo(summary="train ABNet-Cloud es->en across two local sites, print BLEU", run=demo,
            add_arguments=_arguments)


def ensure_data(job_data: Path, pair: str) -> None:
    if (job_data / "train.src").exists():
        return
    from services.corpus.prepare import PrepareConfig, prepare
    print(f"nebula demo: preparing the {pair} corpus from Debian translation packages (once) ...", flush=True)
    prepare(PrepareConfig(pairs=(pair,), out=job_data.parent))


def watch(group, run: Path, total: int, driver: str, sink: str) -> None:
    from tqdm import tqdm

    from nebula.runtime.metrics import read_records
    with tqdm(total=total, desc="training", unit="step") as bar:
        while not group.services[driver].finished():
            group.poll()
            steps = [r for r in read_records(run / sink / "metrics.jsonl") if "loss" in r]
            if steps and steps[-1]["step"] != bar.n:  # redraw only on progress (logs stay short)
                bar.set_postfix(loss=f"{steps[-1]['loss']:.3f}", refresh=False)
                bar.update(steps[-1]["step"] - bar.n)
            time.sleep(0.5)


def codecs_label(job) -> str:
    link = job.links[0].compression[-1].policy
    return f"{link.forward.spec} forward, {link.backward.spec} backward"


def run_demo(job_file: Path, run: Path, steps: int | None, hot: Path | None = None) -> dict:
    from nebula.commands.stage import load
    from nebula.launch import hot_start, start_sites
    from nebula.plots import metric_curve, plot_curves

    job = load(job_file, steps)
    if len(job.stages) != 2 or len(job.sites) != 2:
        raise ConfigError(f"{job_file}: the demo runs a job of two stages at two sites, this one has "
                          f"{list(job.stages)} at {job.sites}")
    driver, sink = job.graph.coordinator, job.graph.sinks[0]
    ensure_data(Path(job.data), Path(job.data).name)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    if hot:
        hot_start(run, hot, list(job.stages))
    started = time.monotonic()
    group = start_sites(run, job_file, steps=steps)
    try:
        watch(group, run, job.train.steps, driver, sink)
    finally:
        group.stop()
    scores_file = run / driver / "scores.json"
    if not scores_file.exists():
        raise StageError(f"the job ended without scores; see the logs in {run / 'logs'}")
    scores = json.loads(scores_file.read_text())
    plot_curves({codecs_label(job): metric_curve(run / sink / "metrics.jsonl")}, run / "loss.png",
                f"{job.name} across two sites", "training loss")
    scores["wall_s"] = round(time.monotonic() - started, 1)
    return scores
