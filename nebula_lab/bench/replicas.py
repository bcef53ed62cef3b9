"""`nebula bench wan --scenario replicas --peer ddp [--json]`: replicas of a model (cross-site data
parallelism, DiLoCo family: docs/replicas.md) against PyTorch DDP over the same emulated WAN, same model,
data and global batch, in one run.

The model is a workload's whole-model job with [replicas] (--workload, default gpt: its
deploy/jobs/gpt-replicas.toml, the bench's d = 128 GPT as one `gpt-whole` stage; `split`: a model a user
brings, transformers' GPT-2 at that size as one split stage, deploy/jobs/split-replicas.toml), replicated R times
(--replicas 2,4: replica k at site k, one torch thread each; the global batch is R x batch_size windows
per step for every system). Settings (--settings; `chosen` is the one the targets are judged on, picked on
validation seeds 4 and 5 among H = 16 / 25 with Nesterov and H = 16 with the mean, docs/replicas.md; --H
changes the H of those at DiLoCo's H = 50):

    ddp        DDP: gloo all-reduce of every step's gradients, float32 (nebula_lab.bench.ddp_peer)
    h1         Nebula's replicas, H = 1, no codec: an outer round (lr 1, no momentum: the replicas' mean,
               which for one inner step is DDP's update up to AdamW's non-linearity) every step
    chosen     H = 16, int4 pseudo-gradients, the replicas' mean as the outer step (lr 1, no momentum: local
               SGD; on 300 steps from a random start Nesterov's momentum overshoots the early rounds)
    diloco     H = 50, int4, Nesterov (lr 0.7, momentum 0.9): DiLoCo's defaults, the job file's
    int8       H = 50, int8, Nesterov
    streaming  H = 50, int4, 2 fragments 25 steps apart, each merged 5 inner steps after its send
    avg, h10   ablations (--settings): diloco with the replicas' mean for the outer step, and with H = 10
    ef, fp32   ablations: chosen with error feedback on its int4 (ef(int4): the same bytes), and with no codec
    sharded    chosen with the sharded exchange (reduce-scatter, all-gather: 2 (R - 1) / R of a pseudo-gradient
               a replica and round, not R - 1 of them; each slice's mean requantised by its owner)
    out15, nest5  candidates for the loss gap: chosen with the mean stepped 1.5x (outer lr 1.5: the average of
               replicas that disagree is shorter than either's move), and with Nesterov momentum 0.5 (lr 1)

Per R, seed and setting the validation curve (nebula_lab.bench.replicas_runs.curve: no root); with root,
each setting timed on a full mesh of shaped links (nebula_lab.wanem) at the communication-bound rate: DDP's
all-reduce wire time per step = --bound-factor (default 5) x a step's compute (calibrated from a short
DDP run on loopback; a ring all-reduce sends 2 (R - 1) / R x 4 bytes per parameter and rank). A row:
system, setting, H, codec, replicas, wan_bytes_per_step (every link's bytes, all frames, per inner step),
val_loss at equal tokens (the mean over seeds at the last round up to --max-steps: 288 of 300 at H = 16),
tokens (seen by then, all replicas), T_s = steps to --time-to-loss (mean over seeds) x s_per_step,
utilisation = compute time / wall time.
--kill: the chosen setting once more with the last replica killed mid-round (replicas_runs.killed).
--lr-schedule: the model's LR after its warm-up for every system (the job's constant, or a linear or cosine
decay to 0: nebula.runtime.lr).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from nebula.errors import ConfigError
from nebula.runtime.lr import DECAYS
from nebula_lab.bench.replicas_runs import last_evaluated
from nebula_lab.bench.scenarios import DdpPeer, LabTools, TorchPeer, hooks, load_scenario
from nebula_lab.bench.wan import _workdir, progress

SITES = "abcdefgh"
TARGET_LOSS = 6.5  # the default --time-to-loss: the GPT time-to-loss bench's (docs/gpt.md)
QUICK_TARGET = 7.3  # --quick's: what its small model reaches in its 40 steps


WARM_SEED = 1000  # a warm-up's data order is its seed's + this: not the order the runs from it take again
DILOCO_H = 50  # DiLoCo's inner steps per round: the settings at it take --H (quick: 10)


@dataclass(frozen=True)
class Setting:
    name: str
    system: str  # nebula | ddp
    H: int = 1
    codec: str = "none"
    fragments: int = 1
    overlap: int = 0
    outer: tuple[float, float] = (0.7, 0.9)  # lr, momentum
    exchange: str = "all-to-all"


SETTINGS = {s.name: s for s in [
    Setting("ddp", "ddp"),
    Setting("h1", "nebula", outer=(1.0, 0.0)),
    Setting("chosen", "nebula", 16, "int4", outer=(1.0, 0.0)),
    Setting("diloco", "nebula", DILOCO_H, "int4"),
    Setting("int8", "nebula", DILOCO_H, "int8"),
    Setting("streaming", "nebula", DILOCO_H, "int4", fragments=2, overlap=5),
    Setting("avg", "nebula", DILOCO_H, "int4", outer=(1.0, 0.0)),
    Setting("h10", "nebula", 10, "int4"),
    Setting("ef", "nebula", 16, "ef(int4)", outer=(1.0, 0.0)),
    Setting("fp32", "nebula", 16, outer=(1.0, 0.0)),
    Setting("sharded", "nebula", 16, "int4", outer=(1.0, 0.0), exchange="sharded"),
    Setting("out15", "nebula", 16, "int4", outer=(1.5, 0.0)),
    Setting("nest5", "nebula", 16, "int4", outer=(1.0, 0.5))]}
DEFAULT = ["ddp", "h1", "chosen", "diloco", "int8", "streaming"]  # the others: ablations, named with --settings
# --quick: a small model on short windows, H = 10, so that a whole run takes minutes on two cores
QUICK_MODEL = {"d_model": 64, "n_layer": 2, "layers": [0, 2], "seq_len": 64, "warmup_steps": 5, "eval_examples": 32}
QUICK = {"H": 10, "steps": 40, "batch": 8}


class ReplicasBench:
    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--replicas", type=_ints, default=None, metavar="2,4",
                           help="replica counts R to compare at (default 2,4; quick 2)")
        group.add_argument("--settings", type=lambda text: text.split(","), default=None,
                           metavar="ddp,h1,chosen", help=f"which settings (default {','.join(DEFAULT)}; quick: "
                           f"ddp,h1,chosen; also {', '.join(set(SETTINGS) - set(DEFAULT))}); ddp needs --peer ddp")
        group.add_argument("--workload", default=None, help="whose whole-model job and peer hooks (default gpt)")
        group.add_argument("--H", type=int, default=None, metavar="H",
                           help="inner steps per round of the settings at DiLoCo's H = 50 (default 50; quick 10)")
        group.add_argument("--lr-schedule", choices=DECAYS, default=None,
                           help="the model's LR after its warm-up, for every system (default: the job's, constant)")
        group.add_argument("--warm-start", type=int, default=None, metavar="W",
                           help="every system starts from one model trained synchronously for W steps (DDP at R = 2 on "
                           f"the data order of seed + {WARM_SEED}, per seed): DiLoCo's regime [default: random]")
        group.add_argument("--kill", action="store_true", default=None,
                           help="also: the chosen setting with the last replica killed mid-round (root)")

    def bench(self, args: argparse.Namespace, lab: LabTools) -> int:
        plan = Plan(args)
        with _workdir(args.workdir) as work:
            rows, kill = plan.run(work)
            if args.workdir:
                (work / "rows.json").write_text(json.dumps({"rows": rows, "kill": kill}, indent=1))
        print(json.dumps({"rows": rows, "kill": kill}, indent=1) if args.json else table(rows, kill, plan.target))
        return 0


class Plan:
    """Which runs, from the arguments; `run` makes them and returns the rows."""

    def __init__(self, args: argparse.Namespace):
        from nebula.runtime.job_file import read_job_table  # why here: torch, kept off `nebula --help`
        from nebula.shipped import deploy_dir
        self.args, self.quick = args, args.quick
        self.workload = args.workload or "gpt"
        names = args.settings or (["ddp", "h1", "chosen"] if self.quick else DEFAULT)
        unknown = [n for n in names if n not in SETTINGS]
        if unknown:
            raise ConfigError(f"--settings: {', '.join(unknown)} unknown; choose from {', '.join(SETTINGS)}")
        if "ddp" in names and args.peer != "ddp":
            names = [n for n in names if n != "ddp"]  # the peer runs only when asked for
        self.settings = [SETTINGS[n] for n in names]
        if any(s.system == "ddp" for s in self.settings):
            scenario = load_scenario(self.workload)
            missing = [hook for kind in (TorchPeer, DdpPeer) for hook in hooks(kind) if not hasattr(scenario, hook)]
            if missing:
                raise ConfigError(f"--peer ddp: the scenario {self.workload} lacks {', '.join(missing)} "
                                  "(nebula_lab.bench.scenarios.DdpPeer)")
        self.counts = args.replicas or ([2] if self.quick else [2, 4])
        if any(not 2 <= r <= len(SITES) for r in self.counts):
            raise ConfigError(f"--replicas {self.counts}: each must be 2 to {len(SITES)}")
        self.seeds = args.seeds or [1]
        self.warm_steps = args.warm_start or 0
        if self.warm_steps < 0:
            raise ConfigError(f"--warm-start {self.warm_steps}: steps of the synchronous warm-up, 0 (none) or more")
        self.inits: dict[int, Path] = {}  # seed -> the warm-up's weights (run fills it)
        self.init_loss: dict[int, float] = {}  # seed -> the warm-up's validation loss at its end
        self.base = read_job_table(args.job or deploy_dir() / "jobs" / f"{self.workload}-replicas.toml")
        if len(self.base.get("stages", {})) != 1 or "replicas" not in self.base:
            raise ConfigError("the replicas bench replicates a one-stage job with a [replicas] table "
                              f"(deploy/jobs/{self.workload}-replicas.toml is one)")
        if self.quick and next(iter(self.base["stages"].values())).get("impl") != "gpt-whole":
            raise ConfigError(f"--quick shrinks the GPT's own model; the {self.workload} job's is its own: run it "
                              "without --quick (fewer steps: --max-steps)")
        self.steps = args.max_steps or (QUICK["steps"] if self.quick else self.base["train"]["steps"])
        # --eval-every: the parser's default (25) means "every round of the settings' largest H"; with DDP
        # alone, `chosen`'s rounds, so that its curve is scored where one run beside `chosen` would be
        rounds = max([self.h(s) for s in self.settings if s.system == "nebula"] or [self.h(SETTINGS["chosen"])])
        self.every = rounds if args.eval_every == 25 else args.eval_every
        self.target = args.time_to_loss if args.time_to_loss is not None else QUICK_TARGET if self.quick \
            else TARGET_LOSS
        for s in self.settings:
            if s.system == "nebula" and self.every % self.h(s):
                raise ConfigError(f"--eval-every {self.every}: a multiple of every setting's H ({self.h(s)} for "
                                  f"{s.name}) so that each evaluation ends a round")

    def h(self, setting: Setting) -> int:
        """The setting's H; those at DiLoCo's H = 50 take --H (quick: 10) instead, and in --quick so does
        every setting with rounds (its 40 steps end on a round of 10)."""
        if setting.H == 1 or not (self.quick or setting.H == DILOCO_H):
            return setting.H
        return self.args.H or (QUICK["H"] if self.quick else setting.H)

    def job(self, setting: Setting, count: int, seed: int, steps: int) -> dict:
        """The whole-model job, R replicas at sites a, b, ..., the setting's rounds, one torch thread each."""
        raw = copy.deepcopy(self.base)
        stage = next(iter(raw["stages"].values()))
        stage["threads"] = 1
        if self.quick:
            stage.update(QUICK_MODEL)
            raw["train"].update(batch_size=QUICK["batch"], micro_batches=2)
        raw["train"].update(seed=seed, steps=steps, checkpoint_every=max(1, self.every), log_every=self.every)
        # a schedule's length is the run's: a speed run's few steps (at most the warm-up) time the same compute
        if self.args.lr_schedule and steps > stage.get("warmup_steps", 0):
            stage["lr_schedule"] = self.args.lr_schedule
        if seed in self.inits:
            stage["init_from"] = str(self.inits[seed])
        raw["replicas"].update(groups=[[SITES[k]] for k in range(count)], H=self.h(setting), codec=setting.codec,
                               fragments=setting.fragments, overlap=setting.overlap if not self.quick else 0,
                               exchange=setting.exchange,
                               outer={"lr": setting.outer[0], "momentum": setting.outer[1]})
        return raw

    def run(self, work: Path) -> tuple[list[dict], dict | None]:
        from nebula_lab.bench.replicas_runs import curve, killed, speed
        rows = []
        root = os.geteuid() == 0 and not self.args.steps_only
        if self.warm_steps:
            for seed in self.seeds:
                self.inits[seed], self.init_loss[seed] = self.warm(work / "warm" / f"seed{seed}", seed)
        if not root:
            progress("step times, WAN bytes and utilisation skipped (--steps-only, or not root: the emulated WAN "
                     "needs it)")
        for count in self.counts:
            rate = self.rate(work / f"r{count}" / "calibrate", count) if root else None
            for setting in self.settings:
                curves = {seed: curve(work / f"r{count}" / f"seed{seed}" / setting.name,
                                      self.job(setting, count, seed, self.steps), setting.system, self.every,
                                      self.workload) for seed in self.seeds}
                timing = speed(work / f"r{count}" / "speed" / setting.name,
                               self.job(setting, count, self.seeds[0], self.timed(setting)), setting.system, rate,
                               self.args.rtt_ms or 0.0, self.workload) if rate else {}
                rows.append(self.row(setting, count, curves, timing, rate))
        kill = None
        if self.args.kill and root:
            chosen = SETTINGS["chosen"]
            h = self.h(chosen)
            kill = killed(work / "kill", self.job(chosen, self.counts[0], self.seeds[0], 6 * h),
                          self.rate(work / "kill-calibrate", self.counts[0]), self.args.rtt_ms or 0.0)
        return rows, kill

    def warm(self, run: Path, seed: int) -> tuple[Path, float]:
        """The warm start of `seed`: DDP at R = 2 for --warm-start steps at the job's own LR schedule, on the
        data order of seed + WARM_SEED; -> its weights' file and its validation loss at the end."""
        from nebula_lab.bench.replicas_runs import curve
        raw = self.job(SETTINGS["ddp"], 2, seed + WARM_SEED, self.warm_steps)
        next(iter(raw["stages"].values())).pop("lr_schedule", None)
        weights = run / "rank0" / "weights.pt"
        if not weights.exists():
            shutil.rmtree(run, ignore_errors=True)  # a curve kept without its weights: train it again
        points = curve(run, raw, "ddp", self.warm_steps, self.workload)
        return weights, points[-1][1]

    def timed(self, setting: Setting) -> int:
        """Steps of a speed run: two whole rounds; or --steps (default 8) after the lead-in."""
        from nebula_lab.bench.replicas_runs import LEAD_IN
        return 2 * self.h(setting) if setting.system == "nebula" and self.h(setting) > 1 else \
            LEAD_IN + (self.args.steps or 8)

    def rate(self, run: Path, count: int) -> float:
        """Mbit/s at which DDP's all-reduce takes --bound-factor x a step's compute (a short DDP run, loopback)."""
        from nebula.runtime.job import load_job
        from nebula.runtime.records import read_records
        from nebula.runtime.service import build_stage
        from nebula_lab.bench.ddp_peer import run_ranks
        from nebula_lab.bench.replicas_runs import LEAD_IN, write
        job_file = write(run, self.job(SETTINGS["ddp"], count, self.seeds[0], LEAD_IN + 4))
        run_ranks(run, job_file, self.workload, count, LEAD_IN + 4, 0)
        compute = statistics.fmean(r["compute_s"] for r in read_records(run / "rank0" / "steps.jsonl", None)[LEAD_IN:])
        job = load_job(job_file)
        params = sum(p.numel() for p in build_stage(job.replica_view(0), next(iter(job.stages)), run / "count",
                                                    quiet=True).trainable().values())
        ring = 2 * (count - 1) / count * 4 * params  # bytes each rank sends per step
        rate = round(min(10_000.0, max(0.1, ring * 8 / (self.args.bound_factor * compute) / 1e6)), 2)
        progress(f"R = {count}: {params} parameters, compute {compute:.3f} s/step, all-reduce {ring / 1e6:.1f} MB "
                 f"per rank and step: {rate} Mbit/s puts it at {self.args.bound_factor:g} x compute")
        return rate

    def row(self, setting: Setting, count: int, curves: dict, timing: dict, rate: float | None) -> dict:
        finals = {seed: c[-1][1] for seed, c in curves.items() if c}
        reached = [next((step for step, loss in c if loss <= self.target), None) for c in curves.values()]
        steps = statistics.fmean(reached) if reached and None not in reached else None
        tokens = self._tokens(count, last_evaluated(self.steps, self.every))  # where val_loss is taken
        return {"system": setting.system, "setting": setting.name, "H": self.h(setting), "codec": setting.codec,
                "fragments": setting.fragments, "replicas": count, "rate_mbit": rate,
                "wan_bytes_per_step": timing.get("wan_bytes_per_step"),
                "val_loss": round(statistics.fmean(finals.values()), 4) if finals else None,
                "val_losses": {str(k): round(v, 4) for k, v in finals.items()}, "tokens": tokens,
                "steps_to_target": steps, "target": self.target, "s_per_step": timing.get("s_per_step"),
                "T_s": round(steps * timing["s_per_step"], 1) if steps and timing else None,
                "utilisation": timing.get("utilisation"), "compute_s": timing.get("compute_s"),
                "seeds": sorted(curves), "setting_detail": asdict(setting), "warm_start": self.warm_steps,
                "init_loss": round(statistics.fmean(self.init_loss[s] for s in curves), 4) if self.init_loss else None}

    def _tokens(self, count: int, steps: int) -> int:
        raw = self.job(SETTINGS["ddp"], count, 1, steps)
        stage = next(iter(raw["stages"].values()))
        seq_len = stage.get("seq_len") or stage.get("data", {}).get("seq_len", 256)  # the GPT's, or a split job's data
        return steps * count * raw["train"]["batch_size"] * seq_len


def _ints(text: str) -> list[int]:
    try:
        return [int(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas, e.g. 2,4") from None


# --- output --------------------------------------------------------------------------------------------
COLUMNS = [("system", "system", 7, "s"), ("setting", "setting", 10, "s"), ("H", "H", 4, "d"),
           ("codec", "codec", 6, "s"), ("R", "replicas", 3, "d"), ("WAN B/step", "wan_bytes_per_step", 12, ",.0f"),
           ("val_loss", "val_loss", 9, ".4f"), ("tokens", "tokens", 10, ",d"), ("steps", "steps_to_target", 7, ".0f"),
           ("s/step", "s_per_step", 8, ".3f"), ("T_s", "T_s", 8, ".1f"), ("util", "utilisation", 6, ".2f")]


def table(rows: list[dict], kill: dict | None, target: float) -> str:
    head = " ".join(f"{t:<{w}}" if f == "s" else f"{t:>{w}}" for t, _, w, f in COLUMNS)
    lines = [head]
    for row in rows:
        lines.append(" ".join(f"{'-':>{w}}" if row[k] is None else f"{row[k]:<{w}}" if f == "s"
                              else f"{row[k]:>{w}{f}}" for _, k, w, f in COLUMNS))
    lines.append(f"(val_loss: mean over seeds at equal tokens; steps: to validation loss {target:g}, mean over seeds; "
                 "T_s = steps x s/step on the emulated WAN; util = compute / wall at replica 0)")
    return "\n".join(lines + verdicts(rows, kill))


def verdicts(rows: list[dict], kill: dict | None) -> list[str]:
    """The issue's targets, per replica count: bytes, loss at equal tokens, time to target; and the kill."""
    out = []
    for count in sorted({r["replicas"] for r in rows}):
        at = {r["setting"]: r for r in rows if r["replicas"] == count}
        for name in ("chosen", "sharded"):
            if at.get("ddp") and at.get(name):
                out += _targets(f"R = {count}: {name}:", at["ddp"], at[name])
    if kill:
        ok = kill["killed_at"] is not None and kill["wait_s"] <= kill["deadline_s"] + 1 and kill["each_step_once"]
        out.append(f"a replica killed mid-round (its step {kill['killed_at']}, restarted {kill['restarts']}x): the "
                   f"others finished the round of step {kill['round_step']} with replicas {kill['contributors']} "
                   f"after {kill['wait_s']} s (deadline {kill['deadline_s']:g} s); it averaged with them again "
                   f"later: {kill['rejoined']}; each step applied once at every stage: {kill['each_step_once']} "
                   f"({'met' if ok else 'NOT met'})")
    return out


def _targets(at: str, ddp: dict, ours: dict) -> list[str]:
    out = []
    if ddp["wan_bytes_per_step"] and ours["wan_bytes_per_step"]:
        ratio = ddp["wan_bytes_per_step"] / ours["wan_bytes_per_step"]
        out.append(f"{at} WAN bytes per step {ratio:.0f}x below DDP's ({'met' if ratio >= 100 else 'NOT met'}, "
                   "target >= 100x)")
    if ddp["val_loss"] and ours["val_loss"]:
        gap = (ours["val_loss"] - ddp["val_loss"]) / ddp["val_loss"]
        out.append(f"{at} validation loss at equal tokens {gap:+.2%} of DDP's over seeds {ours['seeds']} "
                   f"({'met' if gap <= 0.02 else 'NOT met'}, target within 2%)")
        if ddp.get("init_loss"):  # a warm start: the gap beside what DDP gained from the shared start
            drop = ddp["init_loss"] - ddp["val_loss"]
            out.append(f"{at} from a warm start of {ddp['warm_start']} steps at loss {ddp['init_loss']:.4f}: DDP's "
                       f"loss fell {drop:.4f} since, ours {ddp['init_loss'] - ours['val_loss']:.4f} (the gap is "
                       f"{(ours['val_loss'] - ddp['val_loss']) / drop:.0%} of DDP's fall)" if drop > 0 else
                       f"{at} from a warm start at loss {ddp['init_loss']:.4f}: DDP's loss did not fall since")
    if ddp["T_s"] and ours["T_s"]:
        speedup = ddp["T_s"] / ours["T_s"]
        out.append(f"{at} time to loss {ours['target']:g} {speedup:.1f}x better than DDP "
                   f"({'met' if speedup >= 3 else 'NOT met'}, target >= 3x)")
    return out


SCENARIO = ReplicasBench()
