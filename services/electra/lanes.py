"""Many seeds' one-site runs on one machine, N at a time, to a step of their schedule, resumable
(`nebula electra seeds --parallel N --until STEP --resume`).

A plan too long for one sitting (docs/electra.md, "The plan for it on this machine": five seeds, 20,000 steps,
hours each) runs in stages: every seed to step U (`nebula stage one-site --until U`, the job's own schedule,
so the LR at step U is the 20,000-step run's), read there, then on to a later U. A seed already at U is not
started; one stopped part-way (a session's end, a Ctrl-C) continues from its newest checkpoint with the same
schedule, masks and samples, so neither the order nor a stop changes a number. The step-U checkpoint of each
seed is copied to seed-N/kept/<stage>/, because the runtime keeps only step 0 and the 3 newest and later steps
prune it.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from tqdm import tqdm

from nebula.errors import ConfigError
from services.electra import demo

WORKDIR = "one-site"  # seed-N/one-site/<stage>/checkpoints, as `nebula electra seeds` has always written


def checkpoint(run: Path, seed: int, stage: str, step: int) -> Path:
    """Seed `seed`'s checkpoint of `stage` at `step`: the kept copy if there is one, else the run's own."""
    kept = run / f"seed-{seed}" / "kept" / stage / f"step-{step:08d}.pt"
    return kept if done(kept) else run / f"seed-{seed}" / WORKDIR / stage / "checkpoints" / kept.name


def done(path: Path) -> bool:
    """A checkpoint is complete once its checksum file is written (nebula.runtime.checkpoint)."""
    return Path(f"{path}.sha256").is_file()


def newest(run: Path, seed: int, stage: str) -> int:
    """The step of seed `seed`'s newest complete checkpoint of `stage` (0: none), where its run resumes."""
    from nebula.runtime.checkpoint import CheckpointDir  # why here: torch, kept off `nebula --help`
    return max(CheckpointDir(run / f"seed-{seed}" / WORKDIR / stage / "checkpoints").steps(), default=0)


def keep(run: Path, seed: int, stage: str, step: int) -> None:
    """Copy seed `seed`'s step-`step` checkpoint of `stage` to seed-N/kept/ (data first, checksum last)."""
    source = run / f"seed-{seed}" / WORKDIR / stage / "checkpoints" / f"step-{step:08d}.pt"
    target = run / f"seed-{seed}" / "kept" / stage / source.name
    if done(target):
        return
    if not done(source):
        raise ConfigError(f"seed {seed} has no complete step-{step} checkpoint in {source.parent}: its run "
                          "stopped before that step or a later one pruned it; rerun with --resume --until "
                          f"{step} only if no later step was trained (else start a new --run-dir)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    shutil.copy2(f"{source}.sha256", f"{target}.sha256")


def train(run: Path, files: dict[int, Path], stages: list[str], sink: str, until: int,
          parallel: int) -> dict[str, float]:
    """Each seed's one-site run (`files[seed]`) to step `until`, `parallel` at a time, each its own
    `nebula stage one-site` process with a progress bar; -> seconds per seed trained here. A seed whose
    sink already holds step `until` is skipped. Ctrl-C or SIGTERM stops every run; rerun to continue."""
    # why here: torch, kept off `nebula --help`
    from nebula.site.local import interrupted_by_sigterm
    from nebula.site.service import ServiceSpec, nebula_argv
    from nebula.site.supervisor import Supervisor
    waiting = [seed for seed in files if not done(checkpoint(run, seed, sink, until))]
    group, running, times = Supervisor(), {}, {}
    with interrupted_by_sigterm():
        try:
            while waiting or running:
                while waiting and len(running) < parallel:
                    seed = waiting.pop(0)
                    argv = nebula_argv("stage", "one-site", "--job", str(files[seed]), "--workdir",
                                       str(run / f"seed-{seed}" / WORKDIR), "--until", str(until))
                    group.start(ServiceSpec(name=f"seed-{seed}", argv=argv, run=run))
                    free = min(set(range(parallel)) - {lane for *_, lane in running.values()})  # a bar's line
                    bar = tqdm(total=until, initial=newest(run, seed, sink), desc=f"seed {seed}", unit="step",
                               position=free)  # from where it resumes: a rate and ETA of this sitting
                    running[seed] = (demo.Progress(bar, stages), time.monotonic(), free)
                group.poll()  # strict: a run that fails raises, with its log's tail, and stops the others
                for seed, (progress, started, _) in list(running.items()):
                    progress.update(run / f"seed-{seed}" / WORKDIR, f"seed {seed}")
                    if group.services[f"seed-{seed}"].finished():
                        progress.bar.close()
                        times[f"seed-{seed}"] = time.monotonic() - started
                        del running[seed]
                        keep(run, seed, sink, until)  # now: a stop before the others finish keeps it too
                time.sleep(0.5)
        finally:
            group.stop()
    for seed in files:  # and those that were there already
        keep(run, seed, sink, until)
    return times
