"""`nebula bench wan --scenario electra`: paper Tables 3 and 4 (ELECTRA-Cloud throughput) on the emulated WAN.

- Table 3 (homogeneous hardware): throughput with the generator G at site a and the discriminator D at
  site b, the gateways joined by the tbf-shaped link (170 and 60 Mbit/s), divided by the throughput of
  the one-site job (both stages at site a, through its gateway on loopback, no WAN). The runs
  alternate (one site, 170, 60, one site, ...) for `--rounds` rounds, so that other processes' load
  falls on every configuration alike; a ratio is the median of its rounds' ratios (round_ratios), the
  other columns pool the timed steps of all rounds. Table 4 alike.
- Table 4 (heterogeneous hardware): D made k times slower by its labelled compute throttle
  (`slowdown = k`: each micro-batch sleeps in its backward pass until it has taken k x its compute,
  the CPU time it used, as on a k-times-slower device per sub, without taking the CPU the other
  processes need), at 170 Mbit/s, with n = 1, 2, 4 sub-discriminators and with ranks = "auto" (n from
  warm-up step times of G and one sub, services/electra/calibrate.py; measured once, its resolved job
  reused in later rounds). As in the paper, n also multiplies the step: [train] batch_size and
  micro_batches are per rank, times n.

Sizes (SIZES, MAX_LEN below): small BERTs of equal compute per micro-batch, one torch thread per process,
so that on two cores the throttle, not the model or CPU contention, is what makes D slower. The runs train
on a small copy of the generator's corpus with the job's vocabulary (bench_data: model sizes unchanged).

Per run, from the generator's metrics.jsonl (one record per optimizer step) over its timed steps: all
but the first WARMUP (G fills its pace credit, allocations) and the last (the final checkpoint):
- throughput = sum(stats.tokens) / sum(step_s): step_s runs update to update, so the sum is the
  timed wall time, and G trains exactly the tokens D trains on;
- generator_busy = sum(compute_s) / sum(step_s);
- bytes_per_token = the payload G sent on the link (`sent`) / tokens;
- link_bytes_per_token = the bytes both ends' tbf qdiscs counted (both directions: envelopes, CURVE,
  TCP/IP, ACKs, heartbeats) between G's first and last timed record / the tokens of those steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tomllib

from nebula.errors import ConfigError, StageError
from nebula.runtime.records import read_records
from nebula.shipped import deploy_dir  # the job files, in a checkout or a wheel


class Lab(Protocol):
    """What the lab (`nebula bench wan`) hands the scenario's own benchmark: a workload imports nothing of
    the lab (an import contract holds it), it is lent the tools."""

    bound_factor: float  # the lab's default uncompressed wire / compute in the communication-bound regime

    def workdir(self, path: Path | None) -> AbstractContextManager[Path]: ...
    def run_job(self, run: Path, job: dict, label: str, wan: Any = None) -> None: ...
    def emulated_wan(self, *, name_prefix: str, rate_mbit: float, sites: tuple[str, ...]) -> Any: ...


# G as the job's; D deeper, so that its forward and backward cost what G's do (~0.17 s per micro-batch of
# 16 x 64 here; at equal sizes D's is 0.6 x G's, which also samples from a 29k-way softmax at every masked
# position): without the throttle, G and D are equally fast (Table 3), with it D is k times slower (Table 4)
SIZES = {"generator": {"hidden": 128, "layers": 2, "heads": 2, "ffn": 512},
         "discriminator": {"hidden": 128, "layers": 5, "heads": 2, "ffn": 512}}
MAX_LEN = 64
WARMUP = 4  # untimed first steps: credit 2 lets G run 2 steps ahead before D paces it, + first-step allocations
RATES = (170.0, 60.0)  # Table 3's link rates (Mbit/s); Table 4 runs at the first
SUBS = (1, 2, 4)  # Table 4's fixed n; then ranks = "auto"
DEFAULT_SLOWDOWN, DEFAULT_MAX_RANKS = 4.0, 4
# (default, --quick): rounds of every configuration, timed steps per run of Table 3 (~0.3 s each here)
# and of Table 4 (~1 s each)
ROUNDS, STEPS_3, STEPS_4 = (3, 1), (40, 16), (20, 10)
CORPUS_EVERY, VALID_LINES = 10, 200  # the bench's copy of the generator's corpus (bench_data)
TARGET_INTER, TARGET_BUSY, TARGET_SCALING = 0.97, 0.90, 0.85
# options of `nebula bench wan` that vary a link's compression (Table 5): their defaults
COMPRESSION_ONLY = {"job": None, "link": None, "quality": False, "setting": None, "schedule": None,
                    "staleness": None, "micro_batches": None, "plot": None}


@dataclass(frozen=True)
class Config:
    """One configuration of a table: which job, over what link, how slow D is, how many subs."""

    key: str
    one_site: bool
    rate: float | None  # None: one site, loopback, no WAN
    slowdown: float = 1.0
    ranks: int | str = 1  # or "auto"


class ElectraScenario:
    job = deploy_dir() / "jobs" / "electra.toml"
    one_site_job = deploy_dir() / "jobs" / "electra-one-site.toml"

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.description = (
            "Tables 3 and 4: throughput, not compression; of the options above it takes --json, --quick (one "
            f"round, {STEPS_3[1]} and {STEPS_4[1]} timed steps), --steps (timed steps per run; default "
            f"{STEPS_3[0]} in Table 3, {STEPS_4[0]} in Table 4), --seed and --workdir; those that vary or score "
            "codecs (--job, --link, --quality, --setting, --schedule, --staleness, --micro-batches, "
            "--bound-factor, --plot) do not apply and are refused")
        group.add_argument("--slowdown", type=float, default=None, metavar="K",
                           help=f"Table 4: D's compute throttle, k times slower (default {DEFAULT_SLOWDOWN:g})")
        group.add_argument("--max-ranks", type=int, default=None, metavar="N",
                           help=f"Table 4: the most sub-discriminators ranks = \"auto\" may choose "
                                f"(default {DEFAULT_MAX_RANKS})")
        group.add_argument("--table", type=int, choices=(3, 4), default=None,
                           help="run one of the two tables (default: both)")
        group.add_argument("--rounds", type=int, default=None,
                           help=f"run every configuration this many times, alternating; each pools its runs "
                                f"(default {ROUNDS[0]}, quick {ROUNDS[1]})")

    def bench(self, args: argparse.Namespace, lab: Lab) -> int:
        check_options(args, lab.bound_factor)
        if os.geteuid() != 0:
            print("nebula bench wan: skipped: the emulated WAN link needs root (network namespaces and tc)",
                  file=sys.stderr)
            return 2
        with lab.workdir(args.workdir) as work:
            bench_data(self.job, work / "data")
            rows = ((table3(self, args, work, lab) if args.table in (None, 3) else [])
                    + (table4(self, args, work, lab) if args.table in (None, 4) else []))
            (work / "rows.json").write_text(json.dumps(rows, indent=1))  # a kept --workdir has both forms
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print_tables(rows, args)
        return 0


def check_options(args: argparse.Namespace, bound_factor: float) -> None:
    """The compression options of Table 5 do not apply here: say so rather than ignore them."""
    given = [k for k, default in {**COMPRESSION_ONLY, "bound_factor": bound_factor}.items()
             if getattr(args, k, default) != default]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"--scenario electra measures Tables 3 and 4 (throughput), not compression settings: "
                          f"{flags} {'does' if len(given) == 1 else 'do'} not apply (electra takes --quick, "
                          "--steps, --rounds, --slowdown, "
                          "--max-ranks, --seed, --workdir, --json)")
    for name in ("steps", "rounds", "max_ranks"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.slowdown is not None and args.slowdown < 1:
        raise ConfigError(f"--slowdown {args.slowdown:g}: a throttle only slows D down; use k >= 1")


def bench_data(job_file: Path, out: Path) -> Path:
    """A small copy of the generator's corpus (every CORPUS_EVERY-th training line; VALID_LINES of
    valid and test) and the job's vocabulary as a file: the generator tokenises its whole corpus when it
    starts (~18 s for es-en here, per run), while the vocabulary, and so the models' size, stay the
    job's. Lengths, hence tokens per sequence, keep the corpus's distribution."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.job import load_job
    from services.electra import data
    job = load_job(job_file)
    (generator,) = [s.options for s in job.stages.values() if s.impl == "electra-generator"]
    source = data.corpus_dir(Path(job.data), generator.corpus)  # a DataError: run `nebula data prepare`
    (out / generator.corpus).mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", lambda i: i % CORPUS_EVERY == 0), ("valid", lambda i: i < VALID_LINES),
                        ("test", lambda i: i < VALID_LINES)):
        for ext in ("src", "tgt", "ids"):
            lines = (source / f"{split}.{ext}").read_text().splitlines()
            (out / generator.corpus / f"{split}.{ext}").write_text("".join(
                line + "\n" for i, line in enumerate(lines) if keep(i)))
    vocab = data.load_vocab(Path(job.data), generator.vocab_corpora, generator.vocab_file, data.tokenizer())
    vocab.save(out / "vocab.json")
    return out


def chosen(args: argparse.Namespace, name: str, pair: tuple[int, int]) -> int:
    return getattr(args, name, None) or pair[1 if args.quick else 0]


def progress(line: str) -> None:
    print(f"[bench wan electra] {line}", file=sys.stderr, flush=True)


# --- the jobs -------------------------------------------------------------------------------------
def bench_job(scenario: ElectraScenario, config: Config, data: Path, timed: int, seed: int | None,
              max_ranks: int) -> dict:
    """The scenario's job (one-site or two-site) at the bench sizes: WARMUP + `timed` + 1 steps, one
    checkpoint at the end, D with its throttle and n subs (n x the per-rank batch when n is fixed)."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.autoranks import scale_step

    template = scenario.one_site_job if config.one_site else scenario.job
    raw = tomllib.loads(template.read_text())
    raw["job"]["data"] = str(data)  # bench_data's copy
    steps = WARMUP + timed + 1
    train = raw.setdefault("train", {})
    train.update(steps=steps, checkpoint_every=steps, log_every=steps)
    if isinstance(config.ranks, int):  # "auto": resolving scales the step by the n it measures
        scale_step(train, config.ranks)
    if seed is not None:
        train["seed"] = seed
    for stage in raw["stages"].values():
        size = SIZES["generator" if stage["impl"] == "electra-generator" else "discriminator"]
        # on CPU cores even where a GPU is: the throttle emulates slower devices by CPU time, and n subs
        # are n cores (on a GPU, CUDA's asynchronous kernels would leave it nothing to measure)
        stage.update(size=dict(size), max_len=MAX_LEN, threads=1, vocab_file=str(data / "vocab.json"), device="cpu")
    disc = raw["stages"][stage_named(raw, "electra-discriminator")]
    disc.update(slowdown=config.slowdown, ranks=config.ranks, max_ranks=max_ranks)
    return raw


def stage_named(raw: dict, impl: str) -> str:
    return next(name for name, stage in raw["stages"].items() if stage["impl"] == impl)


def resolve_auto(raw: dict, work: Path) -> tuple[dict, dict]:
    """ranks = "auto" measured once, here (nebula.runtime.autoranks, as the launcher would): the
    resolved job and the calibration evidence."""
    # why here: torch, kept off `nebula --help`
    from nebula.runtime.autoranks import resolve
    from nebula.runtime.job_file import write_job_file
    write_job_file(work / "job.toml", raw)
    resolved, evidence = resolve(work / "job.toml", work / "job.resolved.toml", quiet=True)
    return tomllib.loads(resolved.read_text()), next(iter(evidence.values()))


# --- one run ----------------------------------------------------------------------------------------
class LinkCounter:
    """The bytes both ends' tbf qdiscs have counted, read when the generator's step records first
    number `first` and `last` (a thread watches its metrics file; `tc` runs only those two times)."""

    def __init__(self, link, metrics: Path, first: int, last: int):
        self.link, self.metrics, self.marks = link, metrics, [first, last]
        self.snapshots: list[tuple[int, int]] = []  # (records written, qdisc bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="link-counter", daemon=True)

    def __enter__(self) -> LinkCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while self.marks and not self._stop.wait(0.1):
            done = len(read_records(self.metrics))
            if done >= self.marks[0]:
                self.snapshots.append((done, qdisc_bytes(self.link)))
                self.marks.pop(0)


def qdisc_bytes(link) -> int:
    return sum(site["qdisc"]["bytes"] for site in link.status().values())


def measure(run: Path, raw: dict, config: Config, label: str, lab: Lab) -> dict:
    """Runs the job (over a fresh shaped link unless one-site) and sums its generator's timed steps."""
    metrics = run / stage_named(raw, "electra-generator") / "metrics.jsonl"
    steps = raw["train"]["steps"]
    shutil.rmtree(run, ignore_errors=True)  # run_job does too, but the counter must not read a kept run's records
    if config.rate is None:
        lab.run_job(run, raw, label=label)
        snapshots: list[tuple[int, int]] = []
    else:
        sites = tuple(dict.fromkeys(stage["address"].split("/")[0] for stage in raw["stages"].values()))
        with lab.emulated_wan(name_prefix=f"nbe{os.getpid()}", rate_mbit=config.rate, sites=sites) as link:
            with LinkCounter(link, metrics, WARMUP, steps - 1) as counter:
                lab.run_job(run, raw, wan=link, label=label)
        snapshots = counter.snapshots
    return step_sums(read_records(metrics), snapshots, label)


def step_sums(records: list[dict], snapshots: list[tuple[int, int]], label: str = "run") -> dict:
    """Sums over the timed step records (all but the first WARMUP and the last); with two qdisc
    snapshots (records written, bytes), the link bytes between them and the tokens of those steps."""
    timed = records[WARMUP:-1]
    if not timed:
        raise StageError(f"{label}: the generator wrote {len(records)} step records; the timed steps are those "
                         f"after the first {WARMUP} and before the last")
    sums = {"runs": 1, "steps": len(timed), "seconds": sum(r["step_s"] for r in timed),
            "compute_s": sum(r["compute_s"] for r in timed), "tokens": sum(r["stats"]["tokens"] for r in timed),
            "sequences": sum(r["stats"]["sequences"] for r in timed),
            "payload_bytes": sum(sum(r.get("sent", {}).values()) for r in timed)}
    if len(snapshots) == 2:
        (first, before), (last, after) = snapshots
        sums["link_bytes"] = after - before
        sums["link_tokens"] = sum(r["stats"]["tokens"] for r in records[first:last])
    return sums


def pooled(runs: list[dict]) -> dict:
    """Several runs of one configuration as one: every sum added (a ratio of sums, not a mean of ratios)."""
    out: dict = {}
    for sums in runs:
        for key, value in sums.items():
            out[key] = out.get(key, 0) + value
    return out


def rates(sums: dict) -> dict:
    """The row fields of pooled sums."""
    link = sums.get("link_bytes")
    return {"throughput": round(sums["tokens"] / sums["seconds"], 1),
            "sequences_per_step": round(sums["sequences"] / sums["steps"], 1),
            "generator_busy": round(sums["compute_s"] / sums["seconds"], 3),
            "generator_ms_per_sequence": round(1000 * sums["compute_s"] / sums["sequences"], 2),
            "bytes_per_token": round(sums["payload_bytes"] / sums["tokens"], 3),
            "link_bytes_per_token": None if link is None or not sums["link_tokens"]
            else round(link / sums["link_tokens"], 3)}


def run_rounds(configs: list[Config], jobs: dict[str, dict], rounds: int, work: Path,
               table: int, lab: Lab) -> dict[str, list[dict]]:
    """Every configuration once per round, in order, round after round: -> key -> the runs' sums."""
    results: dict[str, list[dict]] = {c.key: [] for c in configs}
    for r in range(1, rounds + 1):
        for config in configs:
            label = f"table {table} {config.key} (round {r}/{rounds})"
            progress(f"{label}: {jobs[config.key]['train']['steps']} steps")
            sums = measure(work / f"t{table}-{config.key}-r{r}", jobs[config.key], config, label, lab)
            shown = rates(sums)
            progress(f"{label}: {shown['throughput']:.0f} tokens/s, generator busy {shown['generator_busy']:.2f}")
            results[config.key].append(sums)
    return results


# --- the tables --------------------------------------------------------------------------------------
def table3(scenario: ElectraScenario, args: argparse.Namespace, work: Path, lab: Lab) -> list[dict]:
    configs = [Config("one-site", True, None)] + [Config(f"{rate:g}mbit", False, rate) for rate in RATES]
    timed = chosen(args, "steps", STEPS_3)
    jobs = {c.key: bench_job(scenario, c, work / "data", timed, args.seed, 1) for c in configs}
    return table3_rows(configs, run_rounds(configs, jobs, chosen(args, "rounds", ROUNDS), work, 3, lab))


def table3_rows(configs: list[Config], results: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration; inter_intra against the one-site row (the first, see round_ratios)."""
    rows = []
    for config in configs:
        sums = pooled(results[config.key])
        ratios = round_ratios(results[config.key], results[configs[0].key])
        rows.append({"table": 3, "link_mbit": config.rate, "inter_intra": round(statistics.median(ratios), 3),
                     **rates(sums), "runs": sums["runs"], "timed_steps": sums["steps"],
                     "throughput_runs": [rates(s)["throughput"] for s in results[config.key]],
                     "inter_intra_rounds": ratios})
    return rows


def round_ratios(runs: list[dict], base: list[dict]) -> list[float]:
    """Each round's throughput / the base configuration's in the same round. A row's ratio is their
    median: a round's runs follow each other, so a burst of load from other processes spoils one round
    (measured: 1548 vs 3727 tokens/s for the same configuration in two rounds), not every ratio."""
    return [round(rates(run)["throughput"] / rates(ref)["throughput"], 3) for run, ref in zip(runs, base)]


def table4(scenario: ElectraScenario, args: argparse.Namespace, work: Path, lab: Lab) -> list[dict]:
    slowdown = args.slowdown or DEFAULT_SLOWDOWN
    most, rate = args.max_ranks or DEFAULT_MAX_RANKS, RATES[0]
    configs = [Config(f"n{n}", False, rate, slowdown, n) for n in SUBS]
    configs.append(Config("auto", False, rate, slowdown, "auto"))
    timed = chosen(args, "steps", STEPS_4)
    jobs = {c.key: bench_job(scenario, c, work / "data", timed, args.seed, most) for c in configs}
    progress(f"table 4: calibrating ranks = \"auto\" (max_ranks {most}): warm-up micro-batches of G and one sub")
    jobs["auto"], evidence = resolve_auto(jobs["auto"], work / "t4-calibration")
    progress(f"table 4: ranks = \"auto\" chose n = {evidence['ranks']} ({json.dumps(evidence)})")
    results = run_rounds(configs, jobs, chosen(args, "rounds", ROUNDS), work, 4, lab)
    return table4_rows(configs, results, evidence)


def table4_rows(configs: list[Config], results: dict[str, list[dict]], evidence: dict) -> list[dict]:
    """One row per n; throughput_ratio against n = 1 (the first row, see round_ratios)."""
    rows = []
    for config in configs:
        sums, auto = pooled(results[config.key]), config.ranks == "auto"
        ratios = round_ratios(results[config.key], results[configs[0].key])
        rows.append({"table": 4, "link_mbit": config.rate, "slowdown": config.slowdown,
                     "n": evidence["ranks"] if auto else config.ranks, "auto": auto, **rates(sums),
                     "throughput_ratio": round(statistics.median(ratios), 3), "runs": sums["runs"],
                     "timed_steps": sums["steps"],
                     "throughput_runs": [rates(s)["throughput"] for s in results[config.key]],
                     "throughput_ratio_rounds": ratios, **({"calibration": evidence} if auto else {})})
    return rows


# --- output ------------------------------------------------------------------------------------------
def print_tables(rows: list[dict], args: argparse.Namespace) -> None:
    g, d = SIZES["generator"], SIZES["discriminator"]
    sizes = (f"G: BERT {g['hidden']} x {g['layers']} layers, D: {d['hidden']} x {d['layers']} (equal compute per "
             f"micro-batch), max_len {MAX_LEN}, random init; 1 torch thread per process, {os.cpu_count()} CPU cores")
    t3, t4 = [r for r in rows if r["table"] == 3], [r for r in rows if r["table"] == 4]
    if t3:
        print_table3(t3, sizes)
    if t4:
        print_table4(t4, sizes)
        print_evidence(t4[-1]["calibration"])
    print_verdict(t3, t4[-1] if t4 else None)


def print_table3(t3: list[dict], sizes: str) -> None:
    print(f"Table 3: throughput, homogeneous (G at a, D at b over the tbf link vs both at a on loopback)\n"
          f"  {sizes}\n  {t3[0]['runs']} alternating rounds, {t3[0]['timed_steps']} timed steps per row; "
          "inter/intra: median of the rounds' ratios")
    print(f"{'link':<11}{'inter/intra':>12}{'tokens/s':>10}{'G busy':>8}{'B/token':>9}{'link B/token':>14}  per round")
    for r in t3:
        link = "one site" if r["link_mbit"] is None else f"{r['link_mbit']:g} Mbit/s"
        print(f"{link:<11}{r['inter_intra']:>12.3f}{r['throughput']:>10.0f}{r['generator_busy']:>8.2f}"
              f"{r['bytes_per_token']:>9.3f}{fmt(r['link_bytes_per_token'], '.2f'):>14}  "
              + " ".join(f"{x:.2f}" for x in r["inter_intra_rounds"]))


def print_table4(t4: list[dict], sizes: str) -> None:
    print(f"\nTable 4: throughput, heterogeneous (D throttled k x slower, n sub-discriminators, "
          f"{t4[0]['link_mbit']:g} Mbit/s)\n  {sizes}\n  {t4[0]['sequences_per_step']:g} sequences per step "
          f"x n; {t4[0]['runs']} alternating rounds; ratio: over n = 1, median of the rounds' ratios; "
          "G ms/seq: G's compute per sequence (CPU contention shows here)")
    print(f"{'k':>4}{'n':>4}{'auto':>6}{'G busy':>8}{'ratio':>7}{'ratio/n':>8}{'tokens/s':>10}{'B/token':>9}"
          f"{'G ms/seq':>10}  per round")
    for r in t4:
        print(f"{r['slowdown']:>4g}{r['n']:>4}{'yes' if r['auto'] else '':>6}{r['generator_busy']:>8.2f}"
              f"{r['throughput_ratio']:>7.2f}{r['throughput_ratio'] / r['n']:>8.2f}{r['throughput']:>10.0f}"
              f"{r['bytes_per_token']:>9.3f}{r['generator_ms_per_sequence']:>10.1f}  "
              + " ".join(f"{x:.2f}" for x in r["throughput_ratio_rounds"]))

def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_evidence(ev: dict) -> None:
    t_gen = 1 / sum(1 / t for t in ev["t_generator_s"].values())
    wanted = math.ceil(1.1 * ev["t_sub_s"] / t_gen)
    capped = f", capped at max_ranks {ev['most']}" if wanted > ev["most"] else ""
    print(f"(ranks = \"auto\": t_G {t_gen:.3f} s, t_sub {ev['t_sub_s']:.3f} s per micro-batch of {ev['micro_batch']} "
          f"(throttle included) -> n = ceil(1.1 x {ev['t_sub_s'] / t_gen:.2f}) = {wanted}{capped}: n = {ev['ranks']})")


def print_verdict(t3: list[dict], auto: dict | None) -> None:
    """The targets of the tables run, reported (not asserted: the numbers depend on what else this machine runs)."""
    def met(value: float, target: float) -> str:
        return f"{'met' if value >= target else 'NOT met'}, target >= {target}"
    said = []
    if t3:
        inter = next(r for r in t3 if r["link_mbit"] == RATES[0])["inter_intra"]
        said.append(f"inter/intra at {RATES[0]:g} Mbit/s {inter:.3f} ({met(inter, TARGET_INTER)})")
    if auto:
        scaling = auto["throughput_ratio"] / auto["n"]
        said.append(f"auto n = {auto['n']}: generator busy {auto['generator_busy']:.2f} "
                    f"({met(auto['generator_busy'], TARGET_BUSY)}), throughput ratio {auto['throughput_ratio']:.2f} = "
                    f"{scaling:.2f} x n ({met(scaling, TARGET_SCALING)} x n)")
    print("\ntargets: " + "; ".join(said))


SCENARIO = ElectraScenario()
