"""`nebula demo`: ABNet-Cloud es->en on two sites as local processes, CURVE on, end to end.

Says what it will show, prepares the corpus if missing, makes both sites' keys, starts two gateways and
the two stages, shows training progress and, once its first steps are timed, how long the rest will take
on this machine; prints the cross-site BLEU and writes a PNG of the loss curve.

While the stages train, this process only watches: twice a second it reads the bytes the sink appended to
its metrics file since the last look (nebula.observe.tail) and polls the processes, well under 1% of a core.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nebula.commands.demo import Demo, check_apart, check_run_dir, fresh_run_dir, job_copy, write_job
from nebula.errors import ConfigError, StageError
from nebula.observe.tail import LastStep
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
    rows = report.examples(run, scores["source"], scores["sink"], split=scores.get("split", "test"))
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


POLL_S = 0.5  # how often the parent looks at the sink's metrics and the processes
# the estimate of the time left: the steps timed (after the first, which load the models and warm up)
TIMED_FROM, TIMED_STEPS = 10, 20
# the held-out translation's time in training steps, a sentence: 0.07-0.18 in the runs of docs/abnet.md ("Ten
# minutes on a slower machine"); its beam search runs on the same cores as the steps, so it scales with them
EVAL_STEPS_PER_SENTENCE = 0.1


class Estimate:
    """How long the rest of the demo takes on this machine, from the pace of its own steps TIMED_FROM to
    TIMED_FROM + TIMED_STEPS: the steps left and the evaluation (EVAL_STEPS_PER_SENTENCE steps a sentence)."""

    def __init__(self, total: int, sentences: int):
        self.total, self.sentences, self.start, self.said = total, sentences, None, False

    def see(self, step: int, now: float) -> str | None:
        """A line to print once the pace is known (once), else None."""
        if self.said or step < TIMED_FROM:
            return None
        if self.start is None:
            self.start = (step, now)
            return None
        done, began = step - self.start[0], self.start[1]
        if done < min(TIMED_STEPS, self.total - TIMED_FROM):
            return None
        self.said = True
        pace = (now - began) / done
        left = (self.total - step) * pace
        evaluate = self.sentences * EVAL_STEPS_PER_SENTENCE * pace
        finish = time.strftime("%H:%M", time.localtime(time.time() + left + evaluate))
        return (f"at this machine's pace ({pace:.2f} s a step over steps {self.start[0]}-{step}): ~{left / 60:.1f} "
                f"min of training left, then ~{evaluate / 60:.1f} min translating {self.sentences} sentences: done "
                f"at about {finish}")


def watch(group, run: Path, total: int, driver: str, sink: str, sentences: int) -> float:
    """A progress bar over the training steps with, once the first steps are timed, how long the rest
    will take here; then a line while the sites evaluate; -> the monotonic time the last step was seen."""
    trained, tail, estimate = None, LastStep(run / sink / "metrics.jsonl"), Estimate(total, sentences)
    with tqdm(total=total, desc="training", unit="step") as bar:
        while not group.services[driver].finished():
            group.poll()
            last = tail.latest()
            if last is not None and last["step"] != bar.n:  # redraw only on progress (logs stay short)
                bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
                bar.update(last["step"] - bar.n)
                line = estimate.see(last["step"], time.monotonic())
                if line:
                    bar.write(line)
            if bar.n >= total and trained is None:
                trained = time.monotonic()
                bar.close()
                print(f"translating the {sentences} held-out sentences across the sites (beam search) ...",
                      flush=True)
            time.sleep(POLL_S)
    return trained or time.monotonic()


def introduce(job, source: str, sentences: int) -> None:
    """What the demo does and will show, before it starts (its time follows once the first steps are timed)."""
    options = job.stage(source).options
    tokens, split = getattr(options, "max_len", "?"), getattr(options, "eval_splits", ("test",))[0]
    print(f"nebula demo: {job.name}, ABNet-Cloud across two sites on this machine (a gateway each, CURVE): "
          f"{job.train.steps} training steps of {job.train.batch_size} sentence pairs (sources of at most {tokens} "
          f"tokens), {codecs_label(job)}; then {sentences} held-out {split} sentences translated across the sites. "
          f"It shows BLEU with its 95% interval, six translations beside their references and the bytes sent "
          f"each way, and says how long it will take here once its first {TIMED_FROM + TIMED_STEPS} steps are "
          "timed.", flush=True)


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
    sentences = getattr(job.stage(driver).options, "eval_examples", 0)
    introduce(job, driver, sentences)
    job_file = write_job(raw, run / "job.toml", job_file)
    ensure_prepared(Path(job.data), log=lambda line: print(f"nebula demo: {line}", flush=True))
    if hot:
        hot_start(run, hot, list(job.stages))
    started = time.monotonic()
    with interrupted_by_sigterm():
        group = start_sites(run, job_file)
        try:
            trained = watch(group, run, job.train.steps, driver, sink, sentences)
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
