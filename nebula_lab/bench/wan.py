"""`nebula bench wan --scenario NAME`: the paper's Table 5 (compression vs speed) on the emulated WAN.

Every site of the scenario's job runs as real services inside its own network namespace
(nebula_lab.wanem): its gateway and its stages, the gateways joined by tbf-shaped links. One training
run per link rate measures every setting: the benchmarked link's [links.compression] holds one
*phase* per setting (nebula.codecs.policy_table), so the model load is paid once per rate, not once per
setting. The first step of each phase is not timed (codec warm-up, and the pipeline still draining
the previous phase), nor is the run's last step (final checkpoint). The scenario (named by a workload's
spec, nebula_lab.bench.scenarios) adapts the job: fixed-shape data, no evaluation.

Rates: the paper's 60 Mbit/s, then a communication-bound rate computed from the 60 Mbit/s run's
uncompressed phase so that uncompressed wire time per step ~= 5x compute time per step (the paper's
regime: 4.42 s/step uncompressed vs 0.86 s/step at its strongest compression).

Per row (all from the stages' own metrics: metrics.jsonl and link.jsonl of each stage):
- forward_ratio / backward_ratio: wire bytes / raw bytes of the tensors sent in that direction on
  the benchmarked link;
- s_per_step: mean time between the driving stage's optimizer steps (synchronous: one step's
  forward of all micro-batches to its update);
- speedup: uncompressed s_per_step (the none/none row, else the first) / this row's, same run;
- overlap_ratio: s_per_step / max(compute, wire), compute = the largest site's compute per step,
  wire = max over links and directions of wire bytes per step / link rate (links are full duplex).
Quality (the scenario's metric, loss curves; --quality) is in nebula_lab/bench/wan_quality.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import tomllib

from nebula import workload
from nebula.errors import ConfigError, StageError
from nebula.runtime.records import read_records
from nebula_lab.bench.cpu import CpuSampler, per_step, read_samples
from nebula_lab.bench.scenarios import (
    LabTools,
    PeerOnly,
    TimeToLoss,
    chosen_name,
    is_own,
    kind_of,
    load_scenario,
    scenario_names,
)
from nebula_lab.wanem import WanLink

PAPER_MBIT = 60.0
# the registered schedules (nebula.runtime.schedules; a test holds the two equal): named here, since
# importing the registry imports torch, which `nebula --help` does not
SCHEDULES = ("synchronous", "1f1b", "forward-only", "gpipe", "one-step-stale")
BOUND_FACTOR = 5.0  # uncompressed wire time / compute time in the communication-bound regime
# Untimed steps before the first phase's: the first bulk transfers overshoot in TCP slow start, and
# a drop in the ~2 s deep tbf queue of a ~1 Mbit/s link costs a retransmission timeout (measured:
# 15 s lost in step 2 when the head ran a step ahead, so steps 1 and 2 were on the wire together).
LEAD_IN = 2

SETTINGS = [("none", "none"), ("fp16", "int8"),
            *[(f"fp16(svd({r}))", "int8") for r in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)],
            ("fp16(lowrank(0.6))", "int8"), ("fp16(lowrank(0.2))", "int8"), ("int8(lowrank(0.2))", "int8"),
            ("int8(lowrank(0.2))", "int8(lowrank(0.5))")]  # gradients beyond int8: the backward wire caps int8 at ~3.8x
QUICK_SETTINGS = [("none", "none"), ("fp16", "int8"), ("int8(lowrank(0.2))", "int8"),
                  ("int8(lowrank(0.2))", "int8(lowrank(0.5))")]


def register(sub) -> None:
    parser = sub.add_parser("wan", help="Table 5: training speed per compression setting over the emulated WAN "
                                        "(root), or quality per setting with --quality; a scenario may run "
                                        "tables of its own instead")
    parser.add_argument("--scenario", default=None,
                        help=f"which workload's scenario ({', '.join(scenario_names()) or 'none installed'}; "
                             "default: the only one installed)")
    parser.add_argument("--job", type=Path, default=None,
                        help="use this job file instead of the scenario's (e.g. all the training data, "
                             "another objective)")
    parser.add_argument("--link", default=None,
                        help="the link whose codecs are varied, e.g. src->sink (default: the job's only link)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    parser.add_argument("--quick", action="store_true", help="4 settings, fewer steps (a few minutes)")
    parser.add_argument("--quality", action="store_true",
                        help="train each setting from the same start, score it, plot loss curves (no WAN needed)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per setting (speed; default 3, quick 2, --auto 4 per round), steps per "
                             "rate (--auto --change; default 30) or training steps per setting (quality; default "
                             "300, quick 20)")
    parser.add_argument("--micro-batches", type=int_list, default=None, metavar="4,8,16",
                        help="override the job's [train].micro_batches; several (with --peer): one run each")
    parser.add_argument("--setting", nargs=2, action="append", metavar=("FORWARD", "BACKWARD"),
                        help="measure this codec pair instead of the built-in list (repeatable; the first is "
                             "the baseline of `speedup`), e.g. --setting none none --setting fp16 int8")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None, help="override the job's [schedule] name")
    parser.add_argument("--peer", choices=("torch", "ddp"), default=None,
                        help="torch: the pipeline against its limit and against torch.distributed.pipelining "
                             "(GPipe, 1F1B) over the same emulated links, per schedule and micro-batch count "
                             "(root; nebula_lab/bench/pipeline.py); ddp, with --scenario replicas: also PyTorch "
                             "DDP (gloo all-reduce every step) on the same links, model, data and global batch "
                             "(nebula_lab/bench/replicas.py)")
    parser.add_argument("--schedules", type=lambda text: text.split(","), default=None, metavar="1f1b,gpipe",
                        help="--peer: Nebula's schedules to run (default synchronous,gpipe,1f1b)")
    parser.add_argument("--bound-factors", type=float_list, default=None, metavar="1,2,5",
                        help="--peer: the communication-bound rates, as wire / busiest compute (default 5)")
    parser.add_argument("--png", action="store_true", help="--peer: also at 200 Mbit/s with 50 ms RTT")
    parser.add_argument("--rounds", type=int, default=None,
                        help="run every configuration this many times, alternating (--peer: default 2; a "
                             "scenario's own tables: its default)")
    parser.add_argument("--staleness", type=int, choices=(0, 1), default=None,
                        help="shorthand: 0 = --schedule synchronous (the paper's), 1 = --schedule one-step-stale "
                             "(stages that wait for gradients run one step ahead: no per-step pipeline bubble)")
    parser.add_argument("--seed", type=int, default=None,
                        help="override the job's [train].seed (initialisation, dropout and example order)")
    parser.add_argument("--setting-staleness", type=staleness_list, default=None, metavar="0,1,1",
                        help="--quality: each --setting's staleness, in order (0 synchronous, 1 one-step-stale), "
                             "so that the costs of staleness and of compression can be told apart")
    parser.add_argument("--seeds", type=int_list, default=None, metavar="1,2,3",
                        help="--quality: train every setting with each seed and report each setting's "
                             "difference from the first over seeds (mean, per seed, intervals)")
    parser.add_argument("--eval-splits", type=lambda text: text.split(","), default=None, metavar="valid,test",
                        help="--quality: the held-out splits scored (default: test)")
    parser.add_argument("--eval-sentences", type=int, default=None, metavar="N",
                        help="--quality: sentences scored per split, spread over it (default: the job's)")
    parser.add_argument("--eval-uncompressed", action="store_true",
                        help="--quality: also score each run's trained weights with every link uncompressed "
                             "(its final checkpoints resumed on one site), the model apart from the codec's "
                             "loss at inference; compared over seeds like the scores through the codecs")
    parser.add_argument("--bound-factor", type=float, default=BOUND_FACTOR,
                        help="uncompressed wire time / compute time at the communication-bound rate (default 5)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="--quality: where the loss-curve PNG goes (default: WORKDIR/loss.png, "
                             "or runs/bench-wan-loss.png without --workdir)")
    parser.add_argument("--auto", action="store_true",
                        help="compression = \"auto\" against every fixed rung of its ladder at 60 Mbit/s, the "
                             "communication-bound rate and a rate 4x lower (root)")
    parser.add_argument("--change", action="store_true",
                        help="with --auto: one run whose link rate changes every --steps steps (default 30): 60 "
                             "Mbit/s, the communication-bound rate, a rate 4x lower, 60 again; how soon auto "
                             "moves and where it settles (root)")
    parser.add_argument("--rtt-ms", type=float, default=None,
                        help="propagation delay added on the emulated link (default 0; 80 with --auto)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep logs, metrics and plots here (default: a temporary directory, removed)")
    parser.add_argument("--time-to-loss", type=float, default=None, metavar="TARGET",
                        help="train each setting until the validation loss reaches TARGET (--seeds), time its "
                             "steps on a chain of emulated links (root), report T = steps x step time "
                             "(a scenario of that kind, e.g. gpt; docs/gpt.md)")
    parser.add_argument("--eval-every", type=int, default=25, metavar="N",
                        help="--time-to-loss: evaluate every N steps (default 25)")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="--time-to-loss: a setting not at TARGET after N steps is reported as not reached "
                             "(default: the job's [train].steps)")
    parser.add_argument("--steps-only", action="store_true",
                        help="--time-to-loss: train to the target only, no step times on the emulated WAN")
    add_scenario_arguments(parser)
    parser.set_defaults(func=run)


def add_scenario_arguments(parser: argparse.ArgumentParser) -> None:
    """A scenario that runs its own benchmark (`bench(args, lab)`) adds options (`add_arguments(group)`),
    shown in a group of their own; the compression options above then need not apply to it. One that
    cannot be loaded is left out here, with a warning, and refused with its reason if chosen."""
    owned = {}
    for name in scenario_names():
        try:
            scenario = load_scenario(name)  # a scenario module imports no torch at import time (nebula.cli)
        except ConfigError as exc:
            workload.warn(str(exc))
            continue
        if is_own(scenario):
            group = parser.add_argument_group(f"only with --scenario {name}")
            scenario.add_arguments(group)
            owned[name] = [action.option_strings[0] for action in group._group_actions]
    parser.set_defaults(scenario_options=owned)


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    check_scenario_options(args)
    if is_own(scenario):  # a workload with tables of its own
        return scenario.bench(args, LabTools(BOUND_FACTOR, _workdir, run_job, WanLink))
    if kind_of(scenario) is PeerOnly:
        raise ConfigError(f"--scenario {chosen_name(args.scenario)}: no table of its own; its model is benchmarked "
                          f"as replicas against DDP: --scenario replicas --workload {chosen_name(args.scenario)} "
                          "--peer ddp")
    if args.peer == "ddp":
        raise ConfigError("--peer ddp compares replicas with DDP: only with --scenario replicas; a pipeline's "
                          "peer is --peer torch")
    if args.peer:
        if os.geteuid() != 0:
            raise ConfigError("--peer torch runs both systems over the emulated WAN, which needs root")
        from nebula_lab.bench.pipeline import run_pipeline
        return run_pipeline(args)
    if args.micro_batches and len(args.micro_batches) > 1:
        raise ConfigError(f"--micro-batches {','.join(map(str, args.micro_batches))}: several counts only with "
                          "--peer torch (one run each); give one")
    if args.time_to_loss is not None or kind_of(scenario) is TimeToLoss:
        from nebula_lab.bench.wan_ttl import run_time_to_loss
        return run_time_to_loss(args)
    if args.quality:  # why here (and below): these modules import this one, and torch and matplotlib
        from nebula_lab.bench.wan_quality import run_quality
        return run_quality(args)
    if args.change:
        if not args.auto:
            raise ConfigError("--change: only with --auto (it changes the link under compression = \"auto\")")
        from nebula_lab.bench.wan_change import run_change
        return run_change(args)
    if args.auto:
        from nebula_lab.bench.wan_auto import run_auto
        return run_auto(args)
    if os.geteuid() != 0:
        print("nebula bench wan: skipped: the emulated WAN link needs root (network namespaces and tc); "
              "run as root, or use --quality, which needs no link", file=sys.stderr)
        return 2
    settings = chosen_settings(args)
    timed = args.steps or (2 if args.quick else 3)
    with _workdir(args.workdir) as work:
        job = bench_job(args, settings, timed, work)
        rows = measure_rate(work / "60mbit", job, PAPER_MBIT, args.rtt_ms or 0.0)
        rate = bound_rate(rows[0], args.bound_factor)
        progress(f"communication-bound rate: {rate} Mbit/s (uncompressed wire = {args.bound_factor:g} x compute)")
        rows += measure_rate(work / "bound", job, rate, args.rtt_ms or 0.0)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
        print_verdict(rows, args.bound_factor)
    return 0


def check_scenario_options(args: argparse.Namespace) -> None:
    """Another scenario's options are refused, not ignored (they default to None)."""
    chosen = chosen_name(args.scenario)  # given, or the only one installed
    for name, flags in getattr(args, "scenario_options", {}).items():
        given = [f for f in flags if name != chosen and getattr(args, f[2:].replace("-", "_")) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --scenario {name}")


def chosen_job(args: argparse.Namespace) -> Path:
    return args.job or load_scenario(args.scenario).job


def base_job(args: argparse.Namespace) -> tuple[dict, str]:
    """The job's raw table, with its data path made absolute (the bench's copy lives elsewhere), and
    the name of the link whose codecs the settings vary."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job
    job_file = chosen_job(args)
    job = load_job(job_file)
    raw = tomllib.loads(Path(job_file).read_text())
    if job.data:
        raw["job"]["data"] = job.data
    if args.link is None and len(job.links) != 1:
        raise ConfigError(f"{job_file} has {len(job.links)} links: choose one with --link "
                          f"({', '.join(link.name for link in job.links)})")
    return raw, job.graph.link(args.link).name if args.link else job.links[0].name


def set_compression(raw: dict, link: str, table: dict) -> None:
    for entry in raw.get("links", []):
        if f"{entry['from']}->{entry['to']}" == link:
            entry["compression"] = table


def float_list(text: str) -> list[float]:
    try:
        return [float(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas, e.g. 1,2,5") from None


def int_list(text: str) -> list[int]:
    try:
        return [int(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas, e.g. 1,2,3") from None


def staleness_list(text: str) -> list[int]:
    values = int_list(text)
    if any(v not in (0, 1) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each staleness is 0 or 1")
    return values


def chosen_settings(args: argparse.Namespace) -> list[tuple[str, str]]:
    if not args.setting:
        return QUICK_SETTINGS if args.quick else SETTINGS
    from nebula.codecs.policy_table import read_policy  # imports the codecs (and torch): only for --setting
    pairs = [tuple(pair) for pair in args.setting]
    read_policy({"phases": [{"steps": 1, "forward": f, "backward": b} for f, b in pairs]}, "--setting")
    return pairs


def progress(line: str) -> None:
    print(f"[bench wan] {line}", file=sys.stderr, flush=True)


class _workdir:
    """The given directory (kept), or a temporary one removed at the end."""

    def __init__(self, path: Path | None):
        self.path, self._tmp = path, None

    def __enter__(self) -> Path:
        if self.path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="nebula-bench-wan-")
            return Path(self._tmp.name)
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path.resolve()

    def __exit__(self, *exc_info) -> None:
        if self._tmp:
            self._tmp.cleanup()


# --- the job: one phase per setting ----------------------------------------------------------------
def bench_job(args: argparse.Namespace, settings: list[tuple[str, str]], timed: int, work: Path,
              first_lead: int = 0) -> dict:
    """The scenario's job, one compression phase per setting on the benchmarked link (1 untimed +
    `timed` steps each; the first phase has LEAD_IN + `first_lead` more untimed steps)."""
    raw, link = base_job(args)
    per_phase = 1 + timed
    # + 1: the final step, which also saves the last checkpoint
    total = per_phase * len(settings) + LEAD_IN + first_lead + 1
    raw["train"].update(steps=total, checkpoint_every=total, log_every=total)
    override_train(raw, args)
    raw = load_scenario(args.scenario).speed_job(raw, work, total)
    phases = [{"steps": per_phase, "forward": f, "backward": b} for f, b in settings]
    phases[0]["steps"] += LEAD_IN + first_lead
    phases[-1]["steps"] += 1
    set_compression(raw, link, {"phases": phases})
    # for the summary; removed from the job file
    raw["bench"] = {"link": link, "scenario": args.scenario, "first_lead": first_lead}
    return raw


def override_train(raw: dict, args: argparse.Namespace) -> None:
    """--micro-batches, --seed, --schedule (--staleness): the job's values unless given."""
    if getattr(args, "micro_batches", None):
        raw["train"]["micro_batches"] = args.micro_batches[0]
    if getattr(args, "seed", None) is not None:
        raw["train"]["seed"] = args.seed
    schedule = getattr(args, "schedule", None)
    if getattr(args, "staleness", None) is not None:
        schedule = ("synchronous", "one-step-stale")[args.staleness]
    if schedule:
        raw.setdefault("schedule", {})["name"] = schedule


def holds_toml(path: Path, table: dict) -> bool:
    """Whether `path` is `table` as write_job_file wrote it (a kept run's job: the very one asked for)."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import job_text

    return path.exists() and path.read_text() == job_text(table)


def sites_job(job: dict) -> dict:
    """The job as the sites read it: without the benchmark's own [bench] table."""
    return {k: v for k, v in job.items() if k != "bench"}


def phases_of(job: dict) -> list[dict]:
    link = next(e for e in job["links"] if f"{e['from']}->{e['to']}" == job["bench"]["link"])
    return link["compression"]["phases"]


def phase_steps(job: dict) -> list[tuple[dict, list[int]]]:
    """(phase, timed steps) for each phase: all but its first step (the run's first 1 + LEAD_IN +
    first_lead) and the run's last step."""
    out, first, last = [], 1, job["train"]["steps"]
    for i, phase in enumerate(phases_of(job)):
        skip = 1 + (LEAD_IN + job["bench"].get("first_lead", 0) if i == 0 else 0)
        steps = [s for s in range(first + skip, first + phase["steps"]) if s != last]
        out.append((phase, steps))
        first += phase["steps"]
    return out


def per_step_link(path: Path, direction: str, link: str | None = None) -> dict[int, dict]:
    """step -> summed raw bytes, wire bytes and encode seconds of the training tensors sent that step
    in `direction` (on `link`, or on any), and the first and last time one was packed (host clock,
    shared by every site's processes). An evaluation's tensors (records naming a `split`) are left
    out: they carry the last step's number but are no part of it."""
    sums: dict[int, dict] = {}
    for r in read_records(path, kind=None):
        if (r.get("dir") == direction and "raw" in r and "split" not in r  # not `auto` events, not inference
                and (link is None or r.get("link") == link)):
            s = sums.setdefault(r["step"], {"raw": 0, "wire": 0, "encode_s": 0.0, "first": r["t"], "last": r["t"]})
            for key in ("raw", "wire", "encode_s"):
                s[key] += r[key]
            s["first"], s["last"] = min(s["first"], r["t"]), max(s["last"], r["t"])
    return sums


def fill(head: dict, bwd: dict) -> float:
    """Pipeline fill: step start at the driver to the first gradient sent back on the benchmarked
    link (the driver's forward of micro-batch 0, its encode and forward wire, the receiver's compute
    of it). After it, a step needs at least the backward wire time; what remains beyond both is the
    drain (the driver's backward of the last micro-batch, optimizer) and any time the backward
    direction sat idle waiting for forward data or compute."""
    return bwd["first"] - (head["t"] - head["step_s"])


def summarise(run: Path, job: dict, rate_mbit: float, rtt_ms: float = 0.0) -> list[dict]:
    """One row per setting (phase), from the stages' metrics.jsonl and link.jsonl."""
    stages = {name: stage["address"].split("/")[0] for name, stage in job["stages"].items()}
    driver, link = next(iter(stages)), job["bench"]["link"]
    src, dst = link.split("->")
    metrics = {name: {r["step"]: r for r in read_records(run / name / "metrics.jsonl")} for name in stages}
    fwd = per_step_link(run / src / "link.jsonl", "forward", link)
    bwd = per_step_link(run / dst / "link.jsonl", "backward", link)
    every = [(name, d, per_step_link(run / name / "link.jsonl", d)) for name in stages for d in ("forward", "backward")]
    rows, schedule = [], job.get("schedule", {}).get("name", "synchronous")
    samples = read_samples(run / "cpu.jsonl")
    for phase, steps in phase_steps(job):
        def mean(values) -> float:
            return statistics.fmean(values)
        step_s = mean(metrics[driver][s]["step_s"] for s in steps)
        compute = {site: mean(sum(metrics[n][s]["compute_s"] for n in stages if stages[n] == site) for s in steps)
                   for site in dict.fromkeys(stages.values())}
        wire_bytes = max(mean(sums.get(s, {"wire": 0})["wire"] for s in steps) for _, _, sums in every)
        wire_s = wire_bytes * 8 / (rate_mbit * 1e6)
        fwd_wire, bwd_wire = mean(fwd[s]["wire"] for s in steps), mean(bwd.get(s, {"wire": 0})["wire"] for s in steps)
        row = {
            "forward": phase["forward"], "backward": phase["backward"], "link": link, "link_mbit": rate_mbit,
            "schedule": schedule, "s_per_step": round(step_s, 3), "speedup": None,
            "overlap_ratio": round(step_s / max(*compute.values(), wire_s), 3),
            "forward_ratio": round(sum(fwd[s]["wire"] for s in steps) / sum(fwd[s]["raw"] for s in steps), 4),
            "backward_ratio": round(sum(bwd[s]["wire"] for s in steps) / sum(bwd[s]["raw"] for s in steps), 4)
            if all(s in bwd for s in steps) else None,
            **{f"compute_{site}_s": round(value, 3) for site, value in compute.items()}, "wire_s": round(wire_s, 3),
            "forward_mb": round(fwd_wire / 1e6, 4), "backward_mb": round(bwd_wire / 1e6, 4),
            "encode_src_s": round(mean(fwd[s]["encode_s"] for s in steps), 4),
            "encode_dst_s": round(mean(bwd[s]["encode_s"] for s in steps), 4) if all(s in bwd for s in steps) else None,
            "bwd_wire_s": round(bwd_wire * 8 / (rate_mbit * 1e6), 3), "fill_s": None, "rest_s": None,
            "timed_steps": len(steps)}
        first = metrics[driver][steps[0]]
        host = per_step(samples, first["t"] - first["step_s"], metrics[driver][steps[-1]]["t"], len(steps)) or {}
        row.update({f"cpu_{kind}_s": host.get(kind) for kind in HOST_KINDS})  # None: not sampled, or no such process
        if schedule == "synchronous" and all(s in bwd for s in steps):  # one step's anatomy (steps overlap otherwise)
            row["fill_s"] = round(mean(fill(metrics[driver][s], bwd[s]) for s in steps), 3)
            row["rest_s"] = round(step_s - row["fill_s"] - row["bwd_wire_s"], 3)
        row.update(step_limit(run, job, metrics, steps, rate_mbit, rtt_ms, step_s))
        rows.append(row)
    base = next((r for r in rows if r["forward"] == r["backward"] == "none"), rows[0])["s_per_step"]
    for row in rows:
        row["speedup"] = round(base / row["s_per_step"], 3)
    return rows


def step_limit(run: Path, job: dict, metrics: dict, steps: list[int], rate_mbit: float, rtt_ms: float,
               step_s: float) -> dict:
    """The limit of these steps (nebula_lab.bench.limit) from what they used: each stage's compute, each link
    direction's wire bytes at the rate, the RTT; -> limit_s, of_limit (limit / step: the fraction of the
    ideal), busiest (the resource the limit is made of)."""
    from nebula.runtime.job import parse_job  # why here: torch, kept off `nebula --help`
    from nebula_lab.bench.limit import limit

    loaded = parse_job(sites_job(job))
    compute = {name: statistics.fmean(metrics[name][s]["compute_s"] for s in steps) for name in job["stages"]}
    wire = {}
    for link in loaded.links:
        for direction, sender in (("forward", link.src), ("backward", link.dst)):
            sums = per_step_link(run / sender / "link.jsonl", direction, link.name)
            wire[(link.name, direction)] = statistics.fmean(sums.get(s, {"wire": 0})["wire"] for s in steps) \
                * 8 / (rate_mbit * 1e6)
    found = limit(loaded.graph, compute, wire, loaded.train.micro_batches, rtt_ms / 1000, loaded.schedule.drains)
    return {"limit_s": round(found["limit_s"], 3), "of_limit": round(found["limit_s"] / step_s, 3),
            "busiest": found["busiest"], "limit_fill_s": round(found["fill_s"], 3)}


def largest_compute(row: dict) -> float:
    """A row's compute per step at its busiest site: the time the wire can hide under."""
    return max(v for k, v in row.items() if k.startswith("compute_"))


def bound_rate(uncompressed: dict, factor: float) -> float:
    """Link rate (Mbit/s) at which uncompressed wire time per step = factor x compute time per step."""
    compute = largest_compute(uncompressed)
    megabytes = max(uncompressed["forward_mb"], uncompressed["backward_mb"])
    return float(f"{megabytes * 8 / (factor * compute):.3g}")


# --- one run over the shaped links -------------------------------------------------------------------
def measure_rate(run: Path, job: dict, rate_mbit: float, rtt_ms: float = 0.0) -> list[dict]:
    sites = list(dict.fromkeys(stage["address"].split("/")[0] for stage in job["stages"].values()))
    progress(f"{rate_mbit} Mbit/s{f', RTT {rtt_ms:g} ms' if rtt_ms else ''}: {job['train']['steps']} steps, "
             f"{len(phases_of(job))} settings")
    with WanLink(name_prefix=f"nbw{os.getpid()}", rate_mbit=rate_mbit, sites=tuple(sites), rtt_ms=rtt_ms) as link:
        run_job(run, job, wan=link, label=f"{rate_mbit} Mbit/s",
                channel={"resend_timeout": resend_timeout(job, rate_mbit)})
        qdisc = {site: st["qdisc"] for site, st in link.status().items()}
    sent = ", ".join(f"{site} {q['bytes']}" for site, q in qdisc.items())
    drops = ", ".join(f"{site} {q['drops']}" for site, q in qdisc.items())
    progress(f"{rate_mbit} Mbit/s: link bytes sent by site: {sent} (all frames, whole run); tbf drops {drops}")
    (run / "qdisc.json").write_text(json.dumps(qdisc, indent=1))
    return summarise(run, job, rate_mbit, rtt_ms)


def resend_timeout(job: dict, rate_mbit: float) -> float:
    """An ACK crosses the link behind whatever the other direction has queued: up to a whole step of
    uncompressed tensors. With the default 5 s go-back-N timer, a link below ~1 Mbit/s resent every
    message of a step (measured: an 18 s step instead of 10.8 s); allow three steps' worth of wire."""
    step_bytes = load_scenario(job["bench"]["scenario"]).step_bytes(job)
    return round(max(5.0, 3 * step_bytes * 8 / (rate_mbit * 1e6)), 1)


def run_job(run: Path, job: dict, label: str, wan: WanLink | None = None, channel: dict | None = None,
            timeout_s: float | None = None, watch: Callable[[int], None] | None = None) -> None:
    """Starts every site's gateway and stages, waits until every stage has finished, stops all.
    `watch(steps)` is called as the steps every stage has finished grow (e.g. to change the link)."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import write_job_file
    from nebula.site.local import start_sites

    shutil.rmtree(run, ignore_errors=True)  # a kept --workdir from an earlier run: start clean
    run.mkdir(parents=True)
    job_file = run / "job.toml"
    write_job_file(job_file, sites_job(job))
    stages = list(job["stages"])
    timeout_s = timeout_s or 300 + 60 * job["train"]["steps"]
    delay_lines = delay_line_pids(wan)  # started with the link, before the sites
    group = start_sites(run, job_file, wan=wan, restart=False, channel=channel)
    started, shown = time.monotonic(), 0
    try:
        with CpuSampler(run / "cpu.jsonl", lambda: host_processes(group, delay_lines)):
            while not all(group.services[n].finished() for n in stages):
                group.poll()  # raises StageError, with the log tail, if anything failed
                if time.monotonic() - started > timeout_s:
                    raise StageError(f"{label}: the job did not finish in {timeout_s:.0f} s; logs in {run / 'logs'}")
                done = min(len(read_records(run / n / "metrics.jsonl")) for n in stages)
                if done > shown:
                    progress(f"{label}: step {done}/{job['train']['steps']} ({time.monotonic() - started:.0f} s)")
                    shown = done
                    if watch is not None:
                        watch(done)
                time.sleep(0.5)
    finally:
        group.stop()


def delay_line_pids(wan) -> list[int]:
    """The emulated link's delay-line processes (none without a delay, or without an emulated link)."""
    if wan is None:
        return []
    return [end["delay_pid"] for site in wan.status().values() for end in site["links"].values()
            if end.get("delay_pid")]


def host_processes(group, delay_lines: list[int]) -> dict[int, str]:
    """pid -> kind for the bench's CPU columns: every rank of every stage, the gateways, the delay lines."""
    kinds = {pid: "delay_lines" for pid in delay_lines}
    for name, service in group.services.items():
        kind = "gateways" if name.startswith("gateway") else "stages"
        kinds.update({proc.pid: kind for proc in service.procs})
    return kinds


# --- output --------------------------------------------------------------------------------------------
COLUMNS = [("forward", "forward", 20, "s"), ("backward", "backward", 20, "s"), ("Mbit/s", "link_mbit", 8, ".3g"),
           ("fwd ratio", "forward_ratio", 10, ".3f"), ("bwd ratio", "backward_ratio", 10, ".3f"),
           ("s/step", "s_per_step", 8, ".2f"), ("limit", "limit_s", 7, ".2f"), ("of lim", "of_limit", 7, ".2f"),
           ("speedup", "speedup", 8, ".2f"), ("overlap", "overlap_ratio", 8, ".2f")]
TAIL = [("wire", "wire_s", 7, ".2f"), ("enc src", "encode_src_s", 8, ".3f"), ("enc dst", "encode_dst_s", 8, ".3f"),
        ("fill", "fill_s", 6, ".2f"), ("bwire", "bwd_wire_s", 6, ".2f"), ("rest", "rest_s", 6, ".2f"),
        ("cpu gw", "cpu_gateways_s", 7, ".3f"), ("cpu dl", "cpu_delay_lines_s", 7, ".3f")]
HOST_KINDS = ("stages", "gateways", "delay_lines")  # host CPU seconds per step, nebula_lab.bench.cpu


def print_table(rows: list[dict]) -> None:
    sites = [k[len("compute_"):-2] for k in rows[0] if k.startswith("compute_")]
    rounds = [("round", "round", 6, "d")] if "round" in rows[0] else []  # --auto: rounds of phases per rate
    computes = [(f"comp {site}", f"compute_{site}_s", 7, ".2f") for site in sites]
    columns = COLUMNS[:2] + rounds + COLUMNS[2:] + computes + TAIL
    print("".join(f"{title:<{w}}" if fmt == "s" else f"{title:>{w}}" for title, _, w, fmt in columns))
    for i, row in enumerate(rows):
        if i and row["link_mbit"] != rows[i - 1]["link_mbit"]:
            print()
        print("".join(f"{row[key]:<{w}}" if fmt == "s" else f"{'-':>{w}}" if row[key] is None
                      else f"{row[key]:>{w}{fmt}}" for _, key, w, fmt in columns))
    print(f"(link {rows[0]['link']}, schedule {rows[0]['schedule']}; seconds per step; limit: the busiest resource "
          "per step plus one fill where the schedule drains (nebula_lab.bench.limit), of lim: limit / s/step;\n"
          " comp: each site's compute; "
          "wire: max link direction bytes / link rate;\n enc src/dst: codec encode time on each end's sender "
          "thread; fill: step start -> first gradient sent back;\n bwire: backward bytes / link rate; "
          "rest = s/step - fill - bwire; fill and rest only for synchronous steps;\n cpu gw/dl: host CPU "
          "seconds per step of both gateways / of the delay lines (RTT > 0))")


def print_verdict(rows: list[dict], factor: float) -> None:
    bound = [r for r in rows if r["link_mbit"] == rows[-1]["link_mbit"]]
    best = max(bound[1:], key=lambda r: r["speedup"])
    print(f"\ncommunication-bound ({bound[0]['link_mbit']} Mbit/s, uncompressed wire {factor:g} x compute): "
          f"best {best['forward']} + {best['backward']}: speedup {best['speedup']:.2f}x "
          f"({'met' if best['speedup'] >= 4 else 'NOT met'}, target >= 4), overlap ratio {best['overlap_ratio']:.2f} "
          f"({'met' if best['overlap_ratio'] <= 1.10 else 'NOT met'}, target <= 1.10)")
