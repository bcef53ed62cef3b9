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
from nebula.launch import ProcessGroup, Service, make_keys, nebula_argv, write_site_configs
from nebula.runtime.job import load_job
from nebula.runtime.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]


def ensure_data(job_data: Path, pair: str) -> None:
    if (job_data / "train.src").exists():
        return
    from nebula.data.prepare import PrepareConfig, prepare
    print(f"nebula demo: preparing the {pair} corpus from Debian translation packages (once) ...", flush=True)
    prepare(PrepareConfig(pairs=(pair,), out=job_data.parent))


def start_gateways(group: ProcessGroup, run: Path, sites: dict[str, Path]) -> None:
    for site, config in sites.items():
        group.start(Service(f"gateway-{site}", nebula_argv("gateway", "run", "--site-config", str(config)),
                            run / "logs" / f"gateway-{site}.log", restart=True))


def start_stage(group: ProcessGroup, run: Path, job_file: Path, name: str, site_config: Path,
                steps: int | None = None) -> None:
    argv = nebula_argv("stage", "run", "--job", str(job_file), "--stage", name, "--site", str(site_config),
                       "--workdir", str(run / name), "--quiet")
    if steps:
        argv += ["--steps", str(steps)]
    group.start(Service(name, argv, run / "logs" / f"{name}.log", restart=True))


def start_services(run: Path, job_file: Path, steps: int | None) -> ProcessGroup:
    job = load_job(job_file)
    make_keys(run / "keys", {name: stage.address for name, stage in job.stages.items()})
    sites = write_site_configs(run)
    group = ProcessGroup()
    start_gateways(group, run, sites)
    for name, stage in job.stages.items():
        start_stage(group, run, job_file, name, sites[stage.site], steps)
    return group


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


def plot(run: Path, tail: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = read_records(run / tail / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="fp16 forward + int8 backward")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (CMLM)")
    ax.set_title("ABNet-Cloud es->en across two sites")
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
    group = start_services(run, job_file, steps)
    try:
        watch(group, run, steps or job.train.steps, head, tail)
    finally:
        group.stop()
    scores_file = run / head / "scores.json"
    if not scores_file.exists():
        raise StageError(f"the job ended without scores; see the logs in {run / 'logs'}")
    scores = json.loads(scores_file.read_text())
    plot(run, tail, run / "loss.png")
    scores["wall_s"] = round(time.monotonic() - started, 1)
    return scores
