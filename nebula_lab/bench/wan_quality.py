"""`nebula bench wan --quality`: Table 5's quality column and Figure 9's loss curves.

Each setting trains the scenario's job for the same number of steps from the same initialisation
(stages seed torch from [train].seed, and the example order from the same seed), with that setting's
codecs on the benchmarked link from the first step, then the scenario scores it (e.g. on a held-out
test set by cross-site inference, through the same codecs). Quality does not depend on
the link rate, so the sites run as local processes over loopback (real gateways, CURVE, wire
encode/decode and codecs), one run per setting: settings cannot share a run, since each must start
from the same weights.

With --seeds (e.g. 1,2,3) every seed trains every setting, the first setting being the reference
(uncompressed, synchronous), and each setting's difference from the reference is reported per split
(--eval-splits valid,test) as its per-seed values, mean and intervals (nebula_lab.bench.seeds).
--setting-staleness 0,1,1 gives each setting its staleness (0 synchronous, 1 one-step-stale), so the
cost of staleness and of compression can be told apart. A run already finished in --workdir is kept, not
re-run: hours of runs survive an interruption.

With --eval-uncompressed each run's trained weights are scored again with every link uncompressed
(its final checkpoints resumed on one site): the model a setting trained, apart from what its codec
loses at inference (a `delta` codec sends every evaluated sentence, a first visit, direct).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import shutil
import statistics
from pathlib import Path

import tomllib

from nebula.errors import ConfigError, StageError
from nebula.observe.plots import plot_curves
from nebula.site.service import ServiceSpec, nebula_argv
from nebula.site.supervisor import run_command
from nebula_lab.bench.scenarios import load_scenario
from nebula_lab.bench.seeds import compare
from nebula_lab.bench.wan import (
    _workdir,
    base_job,
    chosen_settings,
    holds_toml,
    override_train,
    per_step_link,
    progress,
    read_records,
    run_job,
    set_compression,
    sites_job,
)

QUICK_STEPS = 20
UNCOMPRESSED = "uncompressed"  # a run's sub-directory: its weights scored with every link uncompressed
LOSSLESS = {"forward": "none", "backward": "none"}


def run_quality(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    settings = quality_settings(args)
    seeds = args.seeds or [args.seed]
    with _workdir(args.workdir) as work:
        rows, curves = [], {}
        for seed in seeds:
            for forward, backward, staleness in settings:
                job = quality_job(args, forward, backward, staleness, seed, scenario)
                name = slug(forward, backward) + ("" if staleness is None else f"__stale{staleness}")
                run = work / (name if seed is None else f"seed{seed}/{name}")
                label = f"{forward} + {backward}" + ("" if staleness is None else f", staleness {staleness}")
                row, curve = finished(run, job) or train_and_score(run, job, label, seed, staleness, scenario)
                if args.eval_uncompressed:
                    row[UNCOMPRESSED] = score_uncompressed(run, job, scenario)
                rows.append(row)
                curves[label if seed is None else f"{label}, seed {seed}"] = curve
        for row in rows:
            base = next(r for r in rows if r["seed"] == row["seed"])["s_per_step"]
            row["speedup"] = round(base / row["s_per_step"], 3)
        plot_path = args.plot or (work / "loss.png" if args.workdir else Path("runs/bench-wan-loss.png"))
        steps = rows[0]["steps"]
        plot_curves(curves, plot_path, f"{job['job']['name']}: training loss per compression setting", "training loss",
                    smooth=max(1, steps // 20))
        summary = summarise_seeds(work, rows, seeds, settings, scenario) if args.seeds else []
    if args.json:
        print(json.dumps(rows + summary, indent=1))
    else:
        print_quality(rows, plot_path, scenario.quality_key)
        if summary:
            print_seeds(summary)
    return 0


def quality_settings(args: argparse.Namespace) -> list[tuple[str, str, int | None]]:
    """(forward, backward, staleness or None for the job's schedule) per --setting."""
    pairs = chosen_settings(args)
    stale = args.setting_staleness or [None] * len(pairs)
    if len(stale) != len(pairs):
        raise ConfigError(f"--setting-staleness gives {len(stale)} values for {len(pairs)} settings: one per "
                          "--setting, in order")
    return [(f, b, s) for (f, b), s in zip(pairs, stale)]


def train_and_score(run: Path, job: dict, label: str, seed: int | None, staleness: int | None,
                    scenario) -> tuple[dict, list]:
    progress(f"quality: {label}" + ("" if seed is None else f", seed {seed}") + f", {job['train']['steps']} steps")
    run_job(run, job, label=label)
    row, curve = summarise_quality(run, job, job["bench"]["forward"], job["bench"]["backward"], scenario)
    row.update(seed=seed, staleness=staleness, run=str(run))
    (run / "row.json").write_text(json.dumps({"row": row, "curve": curve}))  # a re-run keeps this run
    return row, curve


def finished(run: Path, job: dict) -> tuple[dict, list] | None:
    """The row and loss curve of `run` if it already trained and scored this very job."""
    done = run / "row.json"
    if not done.exists():
        return None
    if not holds_toml(run / "job.toml", sites_job(job)):
        progress(f"quality: {run} trained another job (steps, seed, evaluation...): training again")
        return None
    kept = json.loads(done.read_text())
    progress(f"quality: kept {run} (delete it to train again)")
    return kept["row"], kept["curve"]


def score_uncompressed(run: Path, job: dict, scenario) -> dict:
    """The scenario's scores of `run`'s trained weights with every link uncompressed, and where its
    outputs are (`run`): the final checkpoints resume on one site (`nebula stage one-site`, in-process
    channels), where the finished job only evaluates. A run with no codec on any link is its own; a
    finished re-score of the same job is kept."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import write_job_file

    plain = copy.deepcopy(sites_job(job))
    for entry in plain.get("links", []):
        entry.pop("compression", None)  # a link without the table sends everything uncompressed
    if all(entry.get("compression", LOSSLESS) == LOSSLESS for entry in job.get("links", [])):
        return {"run": str(run), **scenario.quality(run, job)}
    where, steps = run / UNCOMPRESSED, job["train"]["steps"]
    scored = where / "scored"  # written once the scores are: the scoring of where/job.toml finished
    if not (scored.exists() and holds_toml(where / "job.toml", plain)):
        shutil.rmtree(where, ignore_errors=True)
        for stage in job["stages"]:
            (where / stage / "checkpoints").mkdir(parents=True)
            for name in (f"step-{steps:08d}.pt", f"step-{steps:08d}.pt.sha256"):
                if not (run / stage / "checkpoints" / name).exists():
                    raise StageError(f"{run} has no checkpoint {stage}/checkpoints/{name} to score uncompressed: "
                                     "delete the run to train it again")
                shutil.copy(run / stage / "checkpoints" / name, where / stage / "checkpoints" / name)
        write_job_file(where / "job.toml", plain)
        progress(f"quality: scoring {run.parent.name}/{run.name} uncompressed (its step-{steps} weights, on one site)")
        code = run_command(ServiceSpec(name="one-site", run=where, argv=nebula_argv(
            "stage", "one-site", "--job", str(where / "job.toml"), "--workdir", str(where))))
        if code != 0:
            raise StageError(f"scoring {run} uncompressed failed (exit {code}, {where / 'logs' / 'one-site.log'}); "
                             f"the trained run is kept: fix the cause and run the same command again")
        scored.touch()
    return {"run": str(where), **scenario.quality(where, job)}


def slug(forward: str, backward: str) -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in f"{forward}__{backward}")


def quality_job(args: argparse.Namespace, forward: str, backward: str, staleness: int | None = None,
                seed: int | None = None, scenario=None) -> dict:
    scenario = scenario or load_scenario(args.scenario)
    raw, link = base_job(args)
    steps = args.steps or (QUICK_STEPS if args.quick else raw["train"]["steps"])
    raw["train"].update(steps=steps, checkpoint_every=steps, log_every=max(1, steps // 10))
    override_train(raw, args)
    if seed is not None:
        raw["train"]["seed"] = seed
    if staleness is not None:
        raw.setdefault("schedule", {})["name"] = ("synchronous", "one-step-stale")[staleness]
    splits = tuple(args.eval_splits or ["test"])
    raw = scenario.quality_job(raw, args.quick, splits=splits, sentences=args.eval_sentences)
    set_compression(raw, link, {"forward": forward, "backward": backward})
    raw["bench"] = {"link": link, "scenario": args.scenario, "forward": forward, "backward": backward}
    return raw


def summarise_quality(run: Path, job: dict, forward: str, backward: str, scenario) -> tuple[dict, list]:
    link = job["bench"]["link"]
    src, dst = link.split("->")
    driver = next(iter(job["stages"]))
    sink = next(name for name in job["stages"] if (run / name / "metrics.jsonl").exists()
                and any("loss" in r for r in read_records(run / name / "metrics.jsonl")))
    losses = [(r["step"], r["loss"]) for r in read_records(run / sink / "metrics.jsonl") if "loss" in r]
    step_s = [r["step_s"] for r in read_records(run / driver / "metrics.jsonl")][1:]  # step 1: warm-up
    fwd = per_step_link(run / src / "link.jsonl", "forward", link)
    bwd = per_step_link(run / dst / "link.jsonl", "backward", link)
    ratio = lambda sums: round(sum(v["wire"] for v in sums.values()) / sum(v["raw"] for v in sums.values()), 4) \
        if sums else None  # noqa: E731
    row = {"forward": forward, "backward": backward, "link": link, "link_mbit": None,  # loopback: quality only
           "s_per_step": round(statistics.fmean(step_s), 3), "speedup": None, "overlap_ratio": None,
           "forward_ratio": ratio(fwd), "backward_ratio": ratio(bwd), "steps": len(losses),
           "final_loss": round(statistics.fmean(v for _, v in losses[-max(1, len(losses) // 10):]), 4),
           **scenario.quality(run, job)}
    return row, losses


def print_quality(rows: list[dict], plot_path: Path, key: str) -> None:
    name = key.upper() if len(key) <= 5 else key
    splits = [k for k in rows[0] if k.startswith(f"{key}_")]
    plain = [k for k in rows[0].get(UNCOMPRESSED, {}) if k.startswith(f"{key}_")]
    print(f"{'seed':>5}{'forward':>27}{'backward':>22}{'stale':>6}{'fwd ratio':>10}{'bwd ratio':>10}{'steps':>7}"
          f"{'final loss':>11}{name:>8}{'d' + name:>8}{'s/step':>8}" + "".join(f"{k:>12}" for k in splits)
          + "".join(f"{k + ' unc.':>17}" for k in plain))
    for r in rows:
        base = next(b for b in rows if b["seed"] == r["seed"])[key]
        bwd = "-" if r["backward_ratio"] is None else f"{r['backward_ratio']:.3f}"
        print(f"{'-' if r['seed'] is None else r['seed']:>5}{r['forward']:>27}{r['backward']:>22}"
              f"{'-' if r['staleness'] is None else r['staleness']:>6}{r['forward_ratio']:>10.3f}{bwd:>10}"
              f"{r['steps']:>7}{r['final_loss']:>11.3f}{r[key]:>8.2f}{r[key] - base:>8.2f}{r['s_per_step']:>8.2f}"
              + "".join(f"{r[k]:>12.2f}" for k in splits) + "".join(f"{r[UNCOMPRESSED][k]:>17.2f}" for k in plain))
    compared = [r for r in rows if r is not next(b for b in rows if b["seed"] == r["seed"])]
    within = [r for r in compared if abs(r[key] - next(b for b in rows if b["seed"] == r["seed"])[key]) <= 0.5]
    print(f"\n{len(within)} of {len(compared)} compressed runs within 0.5 {name} of their seed's first setting "
          f"({rows[0]['steps']} steps each, loopback; s/step here is compute-bound); loss curves: {plot_path}")


def summarise_seeds(work: Path, rows: list[dict], seeds: list[int], settings: list, scenario) -> list[dict]:
    """Per setting after the first, per split and per evaluation (through the codecs; with
    --eval-uncompressed also uncompressed): the difference from the first setting in the scenario's
    metric, over seeds."""
    def scored(row: dict, evaluation: str) -> dict:  # the row's scores and "run", where its outputs are
        return row if evaluation == "codecs" else row[evaluation]

    def stats(setting: int, split: str, evaluation: str) -> list:
        runs = [scored(r, evaluation) for r in rows if r["seed"] in seeds][setting::len(settings)]
        return [scenario.sentence_stats(Path(r["run"]), read_job(Path(r["run"])), split) for r in runs]

    out = []
    metric = f"{scenario.quality_key}_"  # one score per split: `bleu_test` for the metric `bleu`
    splits = [key.removeprefix(metric) for key in rows[0] if key.startswith(metric)]
    evaluations = ["codecs"] + [UNCOMPRESSED] * (UNCOMPRESSED in rows[0])
    for i, (forward, backward, staleness) in enumerate(settings[1:], start=1):
        for split, evaluation in itertools.product(splits, evaluations):
            reference = stats(0, split, evaluation)
            c = compare(reference, stats(i, split, evaluation), scenario.score_stats)
            out.append({"summary": True, "forward": forward, "backward": backward, "staleness": staleness,
                        "split": split, "eval": evaluation, "seeds": seeds, "sentences": len(reference[0]),
                        "reference": [scored(r, evaluation)[metric + split] for r in rows[0::len(settings)]],
                        "per_seed": [round(d, 2) for d in c.per_seed], "mean_diff": round(c.mean, 2),
                        "interval": [round(v, 2) for v in c.interval],
                        "t_interval": c.t_interval and [round(v, 2) for v in c.t_interval]})
    (work / "seeds.json").write_text(json.dumps(out, indent=1))
    return out


def read_job(run: Path) -> dict:
    return tomllib.loads((run / "job.toml").read_text())


def print_seeds(summary: list[dict]) -> None:
    print(f"\ndifference from the first setting, {len(summary[0]['seeds'])} seeds (95%: bootstrap over seeds "
          "and sentences; t over seeds)")
    print(f"{'forward':<27}{'backward':<22}{'stale':>6}{'split':>7}{'eval':>14}{'sents':>7}{'reference':>20}"
          f"{'per seed':>22}{'mean':>7}{'bootstrap':>16}{'t':>16}")
    for r in summary:
        t = "-" if r["t_interval"] is None else "[{:+.2f}, {:+.2f}]".format(*r["t_interval"])
        print(f"{r['forward']:<27}{r['backward']:<22}{'-' if r['staleness'] is None else r['staleness']:>6}"
              f"{r['split']:>7}{r['eval']:>14}{r['sentences']:>7}{' '.join(f'{v:.2f}' for v in r['reference']):>20}"
              f"{' '.join(f'{v:+.2f}' for v in r['per_seed']):>22}{r['mean_diff']:>+7.2f}"
              f"{'[{:+.2f}, {:+.2f}]'.format(*r['interval']):>16}{t:>16}")
