"""`nebula demo`: ABNet-Cloud es->en on two sites as local processes, CURVE on, end to end.

Prepares the corpus if missing, makes both sites' keys, starts two gateways and the two stages,
shows training progress, prints the cross-site BLEU and writes a PNG of the loss curves.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from nebula.errors import ConfigError, StageError
from nebula.launch import ProcessGroup, start_sites
from nebula.runtime.job import load_job
from nebula.runtime.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]


def ensure_data(job_data: Path, pair: str) -> None:
    if (job_data / "train.src").exists():
        return
    from nebula.data.prepare import PrepareConfig, prepare
    print(f"nebula demo: preparing the {pair} corpus from Debian translation packages (once) ...", flush=True)
    prepare(PrepareConfig(pairs=(pair,), out=job_data.parent))


def watch(group: ProcessGroup, run: Path, total: int, head: str, tail: str) -> None:
    from tqdm import tqdm
    done = group.services[head]
    with tqdm(total=total, desc="training", unit="step") as bar:
        while done.proc.poll() != 0:
            group.poll()
            steps = read_records(run / tail / "metrics.jsonl")
            if steps and steps[-1]["step"] != bar.n:  # redraw only on progress (logs stay short)
                bar.set_postfix(loss=f"{steps[-1]['loss']:.3f}", refresh=False)
                bar.update(steps[-1]["step"] - bar.n)
            time.sleep(0.5)


def plot(run: Path, tail: str, out: Path, job) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = read_records(run / tail / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(6, 4))
    codecs = f"{job.compression.get('forward', 'none')} forward, {job.compression.get('backward', 'none')} backward"
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=codecs)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{job.name} across two sites")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def hot_start(run: Path, source: Path, stages: list[str]) -> None:
    """Seed each stage's checkpoints from a one-site run (`nebula stage one-site`), paper §4.3."""
    for name in stages:
        found = source / name / "checkpoints"
        if not any(found.glob("step-*.pt")):
            raise ConfigError(f"--hot-start {source}: no checkpoints in {found}; run "
                              f"`nebula stage one-site --job JOB --workdir {source}` first")
        shutil.copytree(found, run / name / "checkpoints")


def run_demo(job_file: Path, run: Path, steps: int | None, hot: Path | None = None) -> dict:
    job = load_job(job_file)
    names = list(job.stages)
    if len(names) != 2:
        raise ConfigError(f"{job_file}: the demo runs a two-stage job, this one has {names}")
    head, tail = names
    ensure_data(Path(job.data), Path(job.data).name)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    if hot:
        hot_start(run, hot, names)
    started = time.monotonic()
    group = start_sites(run, job_file, {name: stage.address for name, stage in job.stages.items()}, steps=steps)
    try:
        watch(group, run, steps or job.train.steps, head, tail)
    finally:
        group.stop()
    scores_file = run / head / "scores.json"
    if not scores_file.exists():
        raise StageError(f"the job ended without scores; see the logs in {run / 'logs'}")
    scores = json.loads(scores_file.read_text())
    plot(run, tail, run / "loss.png", job)
    scores["wall_s"] = round(time.monotonic() - started, 1)
    return scores
