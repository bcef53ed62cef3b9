"""The configurations and rows of paper Tables 3 and 4 (`nebula bench wan --scenario electra`).

Table 3, the network in it. The forward-only schedule lets G open step t + c once D has applied step t
(its PACE arrived): with compute T_G and T_D per step, round-trip delay R and wire time w, G's period is
    P = max(T_G, T_D, (T_G + T_D + R + w) / c)
so the default credit c = 2 never quite hides a delay, and c = ceil((T_G + T_D + R + w) / max(T_G, T_D))
does (`hiding_credit`); each delay runs with both, and the longest also with c = 1, where G waits out
every pace round trip (one per step: the ids out, the PACE of the step back). The paper's sequence
length (512) with 8 sequences a step puts ~3,900 ids in each message, as a device's micro-batch of the
paper's model would.

Table 4, an emulated device. D's compute per micro-batch at this machine's speed is measured on a
paper-proportioned D (ERNIE-M Large over Base: twice the layers, 4/3 the width of G), times k: that is
each sub's `device_time`, while a stand-in D (STAND_IN) computes for real, so n subs cost this machine
n stand-ins, not n Ds; each all-reduce carries as many gradient values as that paper-proportioned D has (the
stand-in's own, ~1/27 of them, and zeros: `sync_numel`), so the synchronisation is the size the paper's
would be, over gloo on this machine. G is pinned to a core of its own and D's ranks to the others. What it
measures is the runtime's coordination overhead (scatter, the all-reduce, pace, the credit over the WAN);
n above r = T / t_G is capped by G (the ratio cannot pass r), so each row is read against min(1, r / n).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import tomllib

from services.electra.bench import WARMUP, Lab, measure, pooled, progress, rates, stage_named

# G as the job's; D deeper, so that its forward and backward cost about what G's do (G also samples from a
# 29k-way softmax at every masked position): Table 3 is homogeneous hardware
SIZES = {"generator": {"hidden": 128, "layers": 2, "heads": 2, "ffn": 512},
         "discriminator": {"hidden": 128, "layers": 5, "heads": 2, "ffn": 512}}
# Table 4's D: its real compute ~6 ms a micro-batch, <1% of the device's (with clm_weight = 0, device_job)
STAND_IN = {"hidden": 8, "layers": 1, "heads": 2, "ffn": 32}
MAX_LEN_3, BATCH_3 = 512, 8  # the paper's sequence length; ~3,900 ids a step
MAX_LEN_4, BATCH_4 = 64, 16  # per micro-batch (and per sub: n of them a step)
RATES, RTTS = (170.0, 60.0), (20.0, 80.0, 200.0)  # Mbit/s; ms of round-trip delay
CREDIT = 2  # the shipped jobs'
SUBS = (1, 2, 4, 8)  # Table 4's fixed n; then ranks = "auto"
DEFAULT_SLOWDOWN, DEFAULT_MAX_RANKS = 4.0, 16
ROUNDS, STEPS_3, STEPS_4 = (2, 1), (10, 5), (12, 6)  # (default, --quick)
TARGET_INTER, TARGET_BUSY, TARGET_SCALING = 0.97, 0.95, 0.85


@dataclass(frozen=True)
class Config:
    """One configuration of a table: which job, over what link, with which credit, how many subs."""

    key: str
    one_site: bool
    rate: float | None = None  # None: one site, loopback, no WAN
    rtt_ms: float = 0.0
    credit: int = CREDIT
    ranks: int | str = 1  # or "auto"


def chosen(args: argparse.Namespace, name: str, pair: tuple[int, int]) -> int:
    return getattr(args, name, None) or pair[1 if args.quick else 0]


def bench_job(scenario, config: Config, data: Path, timed: int, seed: int | None, table: int) -> dict:
    """The scenario's job (one-site or two-site) at the table's sizes: WARMUP + `timed` + 1 steps, one
    checkpoint at the end; one thread per process, on CPU cores even where a GPU is."""
    template = scenario.one_site_job if config.one_site else scenario.job
    raw = tomllib.loads(template.read_text())
    raw["job"]["data"] = str(data)  # bench_data's copy
    steps = WARMUP + timed + 1
    train = raw.setdefault("train", {})
    train.update(steps=steps, checkpoint_every=steps, log_every=steps, micro_batches=1,
                 batch_size=BATCH_3 if table == 3 else BATCH_4)
    if seed is not None:
        train["seed"] = seed
    raw["schedule"] = {"name": "forward-only", "credit": config.credit}
    for stage in raw["stages"].values():
        size = SIZES["generator" if stage["impl"] == "electra-generator" else "discriminator"]
        stage.update(size=dict(size), max_len=MAX_LEN_3 if table == 3 else MAX_LEN_4, threads=1,
                     vocab_file=str(data / "vocab.json"), device="cpu")
        stage.pop("init", None)  # random weights: throughput does not depend on them
    return raw


# --- Table 3 ----------------------------------------------------------------------------------------
def hiding_credit(t_generator: float, t_disc: float, rtt_s: float, wire_s: float = 0.0) -> int:
    """The least credit c with (T_G + T_D + R + w) / c <= max(T_G, T_D): G never waits for a PACE."""
    return max(CREDIT, math.ceil((t_generator + t_disc + rtt_s + wire_s) / max(t_generator, t_disc)))


def table3(scenario, args: argparse.Namespace, work: Path, lab: Lab) -> list[dict]:
    """One site first (its compute sets the hiding credits), then every rate x delay x credit, in rounds."""
    timed, rounds = chosen(args, "steps", STEPS_3), chosen(args, "rounds", ROUNDS)
    rtts = (args.rtt_ms,) if getattr(args, "rtt_ms", None) is not None else RTTS
    one = Config("one-site", True)
    job = lambda c: bench_job(scenario, c, work / "data", timed, args.seed, 3)  # noqa: E731
    first = run_config(one, job(one), work, 3, 1, rounds, lab)
    t_g, t_d = (first[k] / first["steps"] for k in ("compute_s", "disc_compute_s"))
    configs = [one]
    for rate in RATES:
        for rtt in rtts:
            # credit 1 at the longest delay: G waits out every pace round trip, the cost the credit hides
            unhidden = {1} if rtt == max(rtts) else set()
            credits = sorted({CREDIT, hiding_credit(t_g, t_d, rtt / 1000)} | unhidden)
            configs += [Config(f"{rate:g}mbit-{rtt:g}ms-c{c}", False, rate, rtt, c) for c in credits]
    results = run_rounds(configs, {c.key: job(c) for c in configs}, rounds, work, 3, lab, done={"one-site": [first]})
    return table3_rows(configs, results)


def table3_rows(configs: list[Config], results: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration; inter_intra against the one-site row (the first, see round_ratios), and
    the period the pace model predicts from the row's own compute and delay."""
    rows = []
    for config in configs:
        sums = pooled(results[config.key])
        r = rates(sums)
        ratios = round_ratios(results[config.key], results[configs[0].key])
        wire = sums["payload_bytes"] / sums["steps"] * 8 / (config.rate * 1e6) if config.rate else 0.0
        model = max(r["generator_compute_s"], r["disc_compute_s"],
                    (r["generator_compute_s"] + r["disc_compute_s"] + config.rtt_ms / 1000 + wire) / config.credit)
        rows.append({"table": 3, "link_mbit": config.rate, "rtt_ms": config.rtt_ms, "credit": config.credit,
                     "inter_intra": round(statistics.median(ratios), 3), "inter_intra_rounds": ratios,
                     "model_step_s": round(model, 4), "wire_s": round(wire, 4), **r,
                     "throughput_runs": [rates(s)["throughput"] for s in results[config.key]]})
    return rows


def round_ratios(runs: list[dict], base: list[dict]) -> list[float]:
    """Each round's throughput / the base configuration's in the same round. A row's ratio is their
    median: a round's runs follow each other, so a burst of load from other processes spoils one round
    (measured: 1548 vs 3727 tokens/s for the same configuration in two rounds), not every ratio."""
    return [round(rates(run)["throughput"] / rates(ref)["throughput"], 3) for run, ref in zip(runs, base)]


def run_config(config: Config, raw: dict, work: Path, table: int, r: int, rounds: int, lab: Lab) -> dict:
    label = f"table {table} {config.key} (round {r}/{rounds})"
    progress(f"{label}: {raw['train']['steps']} steps")
    sums = measure(work / f"t{table}-{config.key}-r{r}", raw, config.rate, config.rtt_ms, label, lab)
    shown = rates(sums)
    progress(f"{label}: {shown['throughput']:.0f} tokens/s, generator busy {shown['generator_busy']:.2f}")
    return sums


def run_rounds(configs: list[Config], jobs: dict[str, dict], rounds: int, work: Path, table: int, lab: Lab,
               done: dict[str, list[dict]] | None = None) -> dict[str, list[dict]]:
    """Every configuration once per round, in order, round after round (runs in `done` count as the first
    of theirs): -> key -> the runs' sums."""
    results: dict[str, list[dict]] = {c.key: list((done or {}).get(c.key, [])) for c in configs}
    for r in range(1, rounds + 1):
        for config in configs:
            if len(results[config.key]) < r:
                results[config.key].append(run_config(config, jobs[config.key], work, table, r, rounds, lab))
    return results


# --- Table 4 ----------------------------------------------------------------------------------------
def paper_proportioned(size: dict) -> dict:
    """D as ERNIE-M Large is to Base (24 x 1024 over 12 x 768): twice the layers, 4/3 the width."""
    heads = size["heads"]
    hidden = max(heads, round(size["hidden"] * 4 / 3 / heads) * heads)
    return {"hidden": hidden, "layers": 2 * size["layers"], "heads": heads, "ffn": 4 * hidden}


def cores() -> tuple[list[int], list[int]]:
    """(G's core, D's cores): the first this process may use, and the rest (or the same one, if alone)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:1], allowed[1:] or allowed[:1]


def device_job(raw: dict, device: dict, ranks: int | str, most: int) -> dict:
    """Table 4's job: G on its own core, D a stand-in on the others with the device's time per micro-batch,
    all-reducing as many gradient values as the paper-proportioned D it stands for (measure_device)."""
    raw = copy.deepcopy(raw)
    g_core, d_cores = cores()
    raw["stages"][stage_named(raw, "electra-generator")]["cpus"] = g_core
    disc = raw["stages"][stage_named(raw, "electra-discriminator")]
    disc.update(size=dict(STAND_IN), clm_weight=0.0, device_time=round(device["device_time_s"], 4), cpus=d_cores,
                ranks=ranks, max_ranks=most, sync_numel=device["sync_numel"])
    if isinstance(ranks, int):  # "auto": resolving scales the step by the n it measures
        from nebula.runtime.autoranks import scale_step  # why here: torch, kept off `nebula --help`
        scale_step(raw["train"], ranks)
    return raw


def measure_device(raw: dict, work: Path, slowdown: float) -> dict:
    """t_G and a paper-proportioned D's compute per micro-batch here (services.electra.calibrate, no device
    time), and the emulated device's time: k times the latter."""
    from nebula.runtime.job import parse_job
    from services.electra.calibrate import measure as warm_up  # why here: torch, kept off `nebula --help`
    probe = copy.deepcopy(raw)
    size = paper_proportioned(probe["stages"][stage_named(probe, "electra-generator")]["size"])
    probe["stages"][stage_named(probe, "electra-discriminator")]["size"] = size
    (work / "probe").mkdir(parents=True, exist_ok=True)
    _, ev = warm_up(parse_job(probe, work / "probe" / "job.toml"), stage_named(probe, "electra-discriminator"), 1)
    t_g = 1 / sum(1 / t for t in ev["t_generator_s"].values())
    disc = probe["stages"][stage_named(probe, "electra-discriminator")]
    paper, stand_in = (discriminator_numel(Path(disc["vocab_file"]), s, disc["max_len"]) for s in (size, STAND_IN))
    return {"paper_d": size, "t_generator_s": round(t_g, 4), "t_paper_d_s": ev["t_sub_s"], "slowdown": slowdown,
            "device_time_s": round(slowdown * ev["t_sub_s"], 4), "r": round(slowdown * ev["t_sub_s"] / t_g, 2),
            "paper_d_numel": paper, "stand_in_numel": stand_in, "sync_numel": max(0, paper - stand_in)}


def discriminator_numel(vocab_file: Path, size: dict, max_len: int) -> int:
    """The gradient values of a D of `size` (all its weights: the paper's D trains its CLM head too)."""
    from services.electra.model import Discriminator, Size  # why here: torch, kept off `nebula --help`
    from services.models.plm import BertModel
    from services.models.vocab import VocabMap
    model = Discriminator(BertModel(Size(**size).bert(len(VocabMap.load(vocab_file)), max_len)))
    return sum(p.numel() for p in model.parameters())


def table4(scenario, args: argparse.Namespace, work: Path, lab: Lab) -> list[dict]:
    slowdown, most = args.slowdown or DEFAULT_SLOWDOWN, args.max_ranks or DEFAULT_MAX_RANKS
    base = bench_job(scenario, Config("t4", False, RATES[0]), work / "data", chosen(args, "steps", STEPS_4),
                     args.seed, 4)
    progress("table 4: timing G and a paper-proportioned D here (warm-up micro-batches)")
    device = measure_device(base, work, slowdown)
    progress(f"table 4: {device}")
    configs = [replace(Config(f"n{n}", False, RATES[0]), ranks=n) for n in SUBS]
    configs.append(replace(Config("auto", False, RATES[0]), ranks="auto"))
    jobs = {c.key: device_job(base, device, c.ranks, most) for c in configs}
    progress(f"table 4: calibrating ranks = \"auto\" (max_ranks {most}): warm-up micro-batches of G and one sub")
    jobs["auto"], evidence = resolve_auto(jobs["auto"], work / "t4-calibration")
    progress(f"table 4: ranks = \"auto\" chose n = {evidence['ranks']} ({evidence})")
    results = run_rounds(configs, jobs, chosen(args, "rounds", ROUNDS), work, 4, lab)
    return table4_rows(configs, results, evidence, device)


def resolve_auto(raw: dict, work: Path) -> tuple[dict, dict]:
    """ranks = "auto" measured once, here (nebula.runtime.autoranks, as the launcher would): the
    resolved job and the calibration evidence."""
    from nebula.runtime.autoranks import resolve  # why here: torch, kept off `nebula --help`
    from nebula.runtime.job_file import write_job_file
    work.mkdir(parents=True, exist_ok=True)
    write_job_file(work / "job.toml", raw)
    resolved, evidence = resolve(work / "job.toml", work / "job.resolved.toml", quiet=True)
    return tomllib.loads(resolved.read_text()), next(iter(evidence.values()))


def table4_rows(configs: list[Config], results: dict[str, list[dict]], evidence: dict, device: dict) -> list[dict]:
    """One row per n; throughput_ratio against n = 1 (the first row, see round_ratios); per_sub = ratio / n,
    beside its ceiling: G, at r = T / t_G micro-batches per D micro-batch, caps the ratio at r, so per_sub at
    min(1, r / n). A row at its ceiling measures r, not the runtime."""
    rows = []
    for config in configs:
        auto = config.ranks == "auto"
        n = evidence["ranks"] if auto else config.ranks
        ratios = round_ratios(results[config.key], results[configs[0].key])
        ratio = statistics.median(ratios)
        rows.append({"table": 4, "link_mbit": config.rate, "n": n, "auto": auto, **rates(pooled(results[config.key])),
                     "throughput_ratio": round(ratio, 3), "per_sub": round(ratio / n, 3),
                     "per_sub_ceiling": round(min(1.0, device["r"] / n), 3), "throughput_ratio_rounds": ratios,
                     "throughput_runs": [rates(s)["throughput"] for s in results[config.key]], "device": device,
                     **({"calibration": evidence} if auto else {})})
    return rows
