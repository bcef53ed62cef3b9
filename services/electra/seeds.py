"""`nebula electra seeds`: does pre-training help over seeds, and does cross-site training match one-site?

A benchmark (issue 38's targets, not a timed test), with the demo's models (services.electra.demo.SETTINGS):
1. G's MLM phase once (deploy/jobs/electra-generator.toml's [train] and lr): the well-trained G every seed
   distils from, and the one fixed corruptor of every evaluation;
2. per training seed, the whole job on one site (`nebula stage one-site`) and across two sites (a gateway
   each, CURVE, a process per stage, the forward-only schedule with its credit), from step 0;
3. `nebula electra eval` twice (services.electra.compare): D at step 0 against D one-site-trained, over the
   seeds (does pre-training help, outside the paired interval?), and D one-site-trained against D
   cross-site-trained (is the cross-site change within the spread between seeds?).

With credit > 0 the two runs of a seed differ only where nondeterminism enters (dropout streams: one
process per stage across sites, one process for both on one site), which is what "within the seed spread"
asks about; with dropout 0 and fixed threads they are equal bit for bit (tests/e2e/test_electra_equal.py).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nebula.commands.demo import MARK, check_run_dir, fresh_run_dir, write_job
from nebula.errors import ConfigError
from services.electra import demo, lanes

SEEDS = (1, 2, 3)
CHECKPOINT_EVERY, KEPT = 500, 2  # with --evaluate-at; the runtime keeps step 0 and the 3 newest: the last + 2


@dataclass(frozen=True)
class Plan:
    """What a seeds benchmark runs and reads besides the training: the split evaluated, whether each seed
    also trains across two sites, earlier steps evaluated too, the step the runs stop at (None: the last),
    how many one-site runs at a time, and whether an earlier run in the directory is continued."""

    split: str = "test"
    cross_site: bool = True
    evaluate_at: list[int] = field(default_factory=list)
    until: int | None = None
    parallel: int = 1
    resume: bool = False


@dataclass(frozen=True)
class Training:
    """What the benchmark changes in the demo's distillation job (None: the demo's): the batch, D's LR
    warm-up, and one thread per stage (several runs at a time, a core each)."""

    batch_size: int | None = None
    warmup_steps: int | None = None
    one_thread: bool = False


STEPS = demo.SETTINGS["train"]["steps"]  # the demo's: what its targets are measured at (~50 min on 2 cores)


def register(actions) -> None:
    p = actions.add_parser("seeds", help="benchmark: D untrained vs pre-trained over seeds, and cross-site vs "
                                         "one-site final RTD AUC, with the demo's models")
    p.add_argument("--run-dir", type=Path, default=Path("runs/electra-seeds"), help="emptied first if it has "
                   "only a previous run's files (default runs/electra-seeds)")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="training seeds, comma-separated (>= 3 "
                   "for a spread worth the name; default 1,2,3)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"distillation steps per run (default {STEPS})")
    p.add_argument("--generator-steps", type=int, default=None, help="G's MLM phase (default: the shipped job's)")
    p.add_argument("--split", choices=("test", "valid"), default="test",
                   help="held-out split of the evaluations: valid where a setting (the step count) is chosen, "
                        "test where it is reported (default test)")
    p.add_argument("--one-site-only", action="store_true",
                   help="train each seed on one site only, no cross-site run (with G frozen the two are equal: "
                        "docs/electra.md, \"Over seeds\"); halves the time")
    p.add_argument("--evaluate-at", default="", metavar="STEPS",
                   help="comma-separated earlier steps whose one-site checkpoints are evaluated too (multiples of "
                        "500, at most 1000 before the last unless an earlier --until kept them), e.g. 1000,1500 of "
                        "2000: where over the run they pass")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the demo's 16)")
    p.add_argument("--warmup-steps", type=int, default=None, help="D's LR warm-up steps (default: the demo's)")
    p.add_argument("--until", type=int, default=None, metavar="STEP",
                   help="train every seed only to STEP of the --steps-long schedule, keep that checkpoint and "
                        "evaluate there; a later --resume --until goes on (default: --steps)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="with --one-site-only: N seeds' runs at a time, one thread per stage (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir instead of emptying it: the same options (the job files "
                        "there must match), finished runs skipped, stopped ones continued from their checkpoints")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_seeds)


def run_seeds(args) -> int:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if len(set(seeds)) < 2 or args.steps < 1:
        raise ConfigError(f"--seeds {args.seeds} --steps {args.steps}: two seeds or more (three for the targets), "
                          "one step or more")
    plan = Plan(args.split, not args.one_site_only, sorted({int(x) for x in args.evaluate_at.split(",") if x.strip()}),
                args.until, args.parallel, args.resume)
    check_plan(plan, args.steps)
    training = Training(args.batch_size, args.warmup_steps, args.parallel > 1)
    run = args.run_dir.resolve()  # the job files name their checkpoints absolutely: a resume from anywhere
    result = benchmark(run, seeds, args.steps, args.generator_steps, plan, training)
    (run / "seeds.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str) if args.json else format_result(result))
    return 0


def check_plan(plan: Plan, steps: int) -> None:
    last = steps if plan.until is None else plan.until
    if plan.until is not None and not (0 < plan.until <= steps and plan.until % CHECKPOINT_EVERY == 0):
        raise ConfigError(f"--until {plan.until}: a multiple of {CHECKPOINT_EVERY} from {CHECKPOINT_EVERY} to "
                          f"--steps {steps} (a step with a checkpoint)")
    if plan.parallel < 1:
        raise ConfigError(f"--parallel {plan.parallel}: 1 or more")
    if (plan.until is not None or plan.parallel > 1) and plan.cross_site:
        raise ConfigError("--until and --parallel train one-site runs only (a cross-site run is four processes "
                          "from step 0): add --one-site-only")
    early = last - KEPT * CHECKPOINT_EVERY  # older checkpoints are pruned unless an earlier --until kept them
    if any(x >= last or x < 0 or x % CHECKPOINT_EVERY or (x < early and not plan.resume) for x in plan.evaluate_at):
        raise ConfigError(f"--evaluate-at {plan.evaluate_at}: multiples of {CHECKPOINT_EVERY} below {last} (--until "
                          f"or --steps), from {early} on unless a step's checkpoints were kept by an earlier "
                          "--until (then add --resume)")


def jobs(run: Path, seeds: list[int], steps: int, generator_steps: int | None, every: int | None = None,
         training: Training = Training(), plan: Plan = Plan()) -> tuple[Path | None, dict]:
    """G's MLM job (None: no phase) and, per seed, its one-site and (plan.cross_site) two-site job files, in
    `run`, emptied first unless plan.resume; checkpoints every `every` steps (default: only the last)."""
    every = every or steps
    from nebula.runtime.job import parse_job  # why here: torch, kept off `nebula --help`
    two, one = (demo.adapted(source, steps, demo.SETTINGS) for source in (demo.DEFAULT_JOB, demo.DEFAULT_ONE_SITE_JOB))
    job = parse_job(two, demo.DEFAULT_JOB)
    demo.check_pair(parse_job(one, demo.DEFAULT_ONE_SITE_JOB), job)
    gen = demo.generator_job(two, job, generator_steps)
    kinds = [("one-site", one, demo.DEFAULT_ONE_SITE_JOB)] + [("two-site", two, demo.DEFAULT_JOB)] * plan.cross_site
    wanted: dict[Path, tuple[dict, Path]] = {}
    if gen is not None:
        wanted[run / "job-generator.toml"] = gen, demo.GENERATOR_JOB
    files: dict[int, dict[str, Path]] = {}
    for seed in seeds:
        files[seed] = {}
        for kind, raw, source in kinds:
            raw = changed(json.loads(json.dumps(raw)), job.graph.sinks[0], training)  # a copy per seed
            raw["train"].update(seed=seed, checkpoint_every=every)  # keeps step 0 and the last (3)
            if gen is not None:
                demo.teach(raw["stages"][job.graph.sources[0]], corruptor(run, job, gen))
            files[seed][kind] = run / f"seed-{seed}" / f"{kind}.toml"
            wanted[files[seed][kind]] = raw, source
    if plan.resume:
        check_resumable(run, wanted)
    else:
        fresh_run_dir(run)
    for path, (raw, source) in wanted.items():
        if not path.is_file():
            write_job(raw, path, source)
    return (run / "job-generator.toml" if gen is not None else None), files


def changed(raw: dict, sink: str, training: Training) -> dict:
    """The demo's job `raw` with `training`'s changes."""
    if training.batch_size is not None:
        raw["train"]["batch_size"] = training.batch_size
    if training.warmup_steps is not None:
        raw["stages"][sink]["warmup_steps"] = training.warmup_steps
    for stage in raw["stages"].values():
        if training.one_thread and "threads" in stage:  # the others take the supervisor's OMP_NUM_THREADS=1
            stage["threads"] = 1
    return raw


def check_resumable(run: Path, wanted: dict[Path, tuple[dict, Path]]) -> None:
    """--resume: `run` is an earlier run of this command whose job files say what these options would."""
    import tomllib

    from nebula.runtime.job_file import job_text  # why here: torch, kept off `nebula --help`
    check_run_dir(run)
    if not (run / MARK).is_file():
        raise ConfigError(f"--resume: {run} holds no earlier run of `nebula electra seeds`: drop --resume")
    for path, (raw, _) in wanted.items():
        if path.is_file() and tomllib.loads(path.read_text()) != tomllib.loads(job_text(raw, None)):
            raise ConfigError(f"--resume: {path} differs from the job these options write (another --steps, "
                              "--generator-steps, --batch-size, --warmup-steps, --parallel or --one-site-only?): "
                              "pass the first run's options, or a new --run-dir without --resume")


def corruptor(run: Path, job, gen: dict) -> Path:
    steps = gen["train"]["steps"]
    return run / "generator" / job.graph.sources[0] / "checkpoints" / f"step-{steps:08d}.pt"


def train_both(run: Path, files: dict[str, Path], steps: int, cross_site: bool = True) -> dict[str, float]:
    """One seed's one-site and (cross_site) two-site runs, from step 0, and their seconds."""
    from nebula.runtime.job import load_job  # why here: torch, kept off `nebula --help`
    from nebula.site.local import start_sites
    job = load_job(files["one-site"])
    times = {}
    with tqdm(total=steps, desc=f"{run.name} one site", unit="step") as bar:
        times["one_site_s"] = demo.one_site_phase(run, files["one-site"], "one-site", None,
                                                  demo.Progress(bar, list(job.stages)))
    if not cross_site:
        return times
    with tqdm(total=steps, desc=f"{run.name} two sites", unit="step") as bar:
        started = time.monotonic()
        group = start_sites(run / "two-site", files["two-site"])
        demo.supervise(group, list(job.stages), demo.Progress(bar, list(job.stages)), run / "two-site", "two sites")
        times["two_site_s"] = time.monotonic() - started
    return times


def benchmark(run: Path, seeds: list[int], steps: int, generator_steps: int | None,
              plan: Plan = Plan(), training: Training = Training()) -> dict[str, Any]:
    from nebula.runtime.job import load_job  # why here: torch, kept off `nebula --help`
    from services.electra.compare import Setting, evaluate_runs
    staged = plan.evaluate_at or plan.until is not None or plan.parallel > 1
    gen_file, files = jobs(run, seeds, steps, generator_steps, CHECKPOINT_EVERY if staged else None, training, plan)
    job = load_job(files[seeds[0]]["one-site"])
    times: dict[str, Any] = {}
    g_ckpt = None
    if gen_file is not None:
        g_ckpt = corruptor(run, job, {"train": {"steps": load_job(gen_file).train.steps}})
        if not lanes.done(g_ckpt):  # a resume trains only what is missing
            with tqdm(total=load_job(gen_file).train.steps, desc="G's MLM phase", unit="step") as bar:
                times["generator_s"] = demo.one_site_phase(run, gen_file, "generator", None,
                                                           demo.Progress(bar, list(job.graph.sources)))
    last = steps if plan.until is None else plan.until
    if plan.cross_site:
        for seed in seeds:
            times[f"seed-{seed}"] = train_both(run / f"seed-{seed}", files[seed], steps, plan.cross_site)
    else:
        times.update(lanes.train(run, {s: files[s]["one-site"] for s in seeds}, list(job.stages),
                                 job.graph.sinks[0], last, plan.parallel))
    sink = job.graph.sinks[0]
    ckpt = lambda seed, step: lanes.checkpoint(run, seed, sink, step)  # noqa: E731
    setting = Setting(job, g_ckpt, encoder_evals=False, split=plan.split)
    at = lambda step: evaluate_runs(setting, [(ckpt(s, 0), ckpt(s, step)) for s in seeds])  # noqa: E731
    out = {"seeds": seeds, "steps": steps, "until": last, "split": plan.split, "times": times, "learnt": at(last),
           "earlier": {step: at(step) for step in plan.evaluate_at}}
    if plan.cross_site:
        two = lambda s: run / f"seed-{s}" / "two-site" / sink / "checkpoints" / f"step-{steps:08d}.pt"  # noqa: E731
        sites = evaluate_runs(setting, [(ckpt(s, steps), two(s)) for s in seeds])
        out.update(cross_site=sites, auc_spread=auc_spread(out["learnt"], sites))
    return out


def auc_spread(learnt: dict, sites: dict) -> dict:
    """Final RTD AUC per seed one-site and cross-site, the mean difference and the seeds' own spread
    (max - min and the standard deviation of the one-site AUCs): is the difference within it?"""
    auc = lambda result: next(r for r in result["rows"] if r["metric"].startswith("ROC-AUC"))  # noqa: E731
    one, two = auc(sites)["before"], auc(sites)["after"]
    diff = statistics.fmean(two) - statistics.fmean(one)
    spread = max(one) - min(one)
    return {"one_site": one, "cross_site": two, "mean_difference": diff, "one_site_range": spread,
            "one_site_sd": statistics.stdev(one) if len(one) > 1 else None, "within": abs(diff) <= spread,
            "untrained": auc(learnt)["before"]}


def format_result(r: dict) -> str:
    from services.electra.compare import format_rows  # why here: torch, kept off `nebula --help`
    earlier = "".join(f"D untrained -> step {step} (of {r['steps']}), over seeds {r['seeds']}:\n{format_rows(e)}\n\n"
                      for step, e in r.get("earlier", {}).items())
    until = r.get("until", r["steps"])
    steps = f"{until} steps" if until == r["steps"] else f"step {until} of a {r['steps']}-step schedule"
    learnt = (f"{earlier}D untrained (step 0) -> one-site pre-trained ({steps}), {r['split']} split, over seeds "
              f"{r['seeds']}:\n{format_rows(r['learnt'])}")
    if "auc_spread" not in r:
        return learnt
    a = r["auc_spread"]
    per_seed = ", ".join(f"seed {s}: {o:.4f} / {t:.4f}" for s, o, t in zip(r["seeds"], a["one_site"], a["cross_site"]))
    return (f"{learnt}\n\nD one-site -> cross-site (credit as the job's), final step:\n"
            f"{format_rows(r['cross_site'])}\n\nfinal RTD AUC one-site / cross-site: {per_seed}; mean difference "
            f"{a['mean_difference']:+.4f}, one-site seeds' range {a['one_site_range']:.4f} "
            f"(sd {a['one_site_sd']:.4f}): "
            f"{'within' if a['within'] else 'outside'} the seed spread")
