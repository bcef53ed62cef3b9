"""`nebula bench wan --scenario electra`: paper Tables 3 and 4 (ELECTRA-Cloud throughput) on the emulated WAN.

- Table 3 (homogeneous hardware, services/electra/bench_tables.py): G at site a, D at site b, the gateways
  joined by the tbf-shaped link at 170 and 60 Mbit/s with 20, 80 and 200 ms of round-trip delay (the
  lab's delay line), at the paper's sequence length (512), against the one-site job. Each delay runs with
  the default credit 2 and with the credit that hides it (bench_tables.hiding_credit).
- Table 4 (heterogeneous hardware): D on an emulated device (services/electra/device.py) k times slower
  than a paper-proportioned D computes here, with n = 1, 2, 4, 8 sub-discriminators and ranks = "auto":
  a measurement of the runtime's coordination overhead, not of compute scaling.

The runs alternate (one configuration after the other, round after round) so that other processes' load
falls on every configuration alike; a ratio is the median of its rounds' ratios, the other columns pool
the timed steps of all rounds. Per run, from the generator's metrics.jsonl (one record per optimizer step)
over its timed steps, all but the first WARMUP (G fills its pace credit, allocations) and the last (the
final checkpoint):
- throughput = sum(stats.tokens) / sum(step_s): step_s runs update to update, so the sum is the timed
  wall time, and G trains exactly the tokens D trains on;
- generator_busy = sum(compute_s) / sum(step_s); G's wait = step_s - compute_s (for its pace);
- bytes_per_token = the payload G sent on the link (`sent`) / tokens;
- link_bytes_per_token = the bytes both ends' tbf qdiscs counted (both directions: envelopes, CURVE,
  TCP/IP, ACKs, heartbeats) between G's first and last timed record / the tokens of those steps.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from nebula.errors import ConfigError, StageError
from nebula.runtime.records import read_records
from nebula.shipped import deploy_dir  # the job files, in a checkout or a wheel

WARMUP = 4  # untimed first steps: G runs ahead on its credit before D paces it, + first-step allocations
CORPUS_EVERY, VALID_LINES = 10, 200  # the bench's copy of the generator's corpus (bench_data)
# options of `nebula bench wan` that vary a link's compression (Table 5): their defaults
COMPRESSION_ONLY = {"job": None, "link": None, "quality": False, "setting": None, "schedule": None,
                    "staleness": None, "micro_batches": None, "plot": None, "peer": None, "schedules": None,
                    "bound_factors": None, "png": False}


class Lab(Protocol):
    """What the lab (`nebula bench wan`) hands the scenario's own benchmark: a workload imports nothing of
    the lab (an import contract holds it), it is lent the tools."""

    bound_factor: float  # the lab's default uncompressed wire / compute in the communication-bound regime

    def workdir(self, path: Path | None) -> AbstractContextManager[Path]: ...
    def run_job(self, run: Path, job: dict, label: str, wan: Any = None) -> None: ...
    def emulated_wan(self, *, name_prefix: str, rate_mbit: float, sites: tuple[str, ...],
                     rtt_ms: float = 0.0) -> Any: ...


class ElectraScenario:
    job = deploy_dir() / "jobs" / "electra.toml"
    one_site_job = deploy_dir() / "jobs" / "electra-one-site.toml"

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        # why here: the tables' module holds the defaults, and nothing of it needs torch at import
        from services.electra import bench_tables as t
        group.description = (
            "Tables 3 and 4: throughput, not compression; of the options above it takes --json, --quick (one "
            "round, fewer timed steps), --steps (timed steps per run), --rtt-ms (Table 3: one delay instead of "
            f"{', '.join(f'{x:g}' for x in t.RTTS)}), --seed and --workdir; those that vary or score codecs are "
            "refused")
        group.add_argument("--slowdown", type=float, default=None, metavar="K",
                           help=f"Table 4: the emulated device is K times slower than a paper-proportioned D "
                                f"computes here (default {t.DEFAULT_SLOWDOWN:g})")
        group.add_argument("--max-ranks", type=int, default=None, metavar="N",
                           help=f"Table 4: the most sub-discriminators ranks = \"auto\" may choose "
                                f"(default {t.DEFAULT_MAX_RANKS})")
        group.add_argument("--table", type=int, choices=(3, 4), default=None,
                           help="run one of the two tables (default: both)")

    def bench(self, args: argparse.Namespace, lab: Lab) -> int:
        # why here: torch, kept off `nebula --help`
        from services.electra import bench_report, bench_tables
        check_options(args, lab.bound_factor)
        if os.geteuid() != 0:
            print("nebula bench wan: skipped: the emulated WAN link needs root (network namespaces and tc)",
                  file=sys.stderr)
            return 2
        with lab.workdir(args.workdir) as work:
            bench_data(self.job, work / "data")
            rows = ((bench_tables.table3(self, args, work, lab) if args.table in (None, 3) else [])
                    + (bench_tables.table4(self, args, work, lab) if args.table in (None, 4) else []))
            (work / "rows.json").write_text(json.dumps(rows, indent=1))  # a kept --workdir has both forms
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            bench_report.print_tables(rows)
        return 0


def check_options(args: argparse.Namespace, bound_factor: float) -> None:
    """The compression options of Table 5 do not apply here: say so rather than ignore them."""
    given = [k for k, default in {**COMPRESSION_ONLY, "bound_factor": bound_factor}.items()
             if getattr(args, k, default) != default]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"--scenario electra measures Tables 3 and 4 (throughput), not compression settings: "
                          f"{flags} {'does' if len(given) == 1 else 'do'} not apply (electra takes --quick, "
                          "--steps, --rounds, --rtt-ms, --slowdown, --max-ranks, --table, --seed, --workdir, --json)")
    for name in ("steps", "rounds", "max_ranks"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "slowdown", None) is not None and args.slowdown < 1:
        raise ConfigError(f"--slowdown {args.slowdown:g}: the emulated device is k times slower; use k >= 1")
    if getattr(args, "rtt_ms", None) is not None and args.rtt_ms < 0:
        raise ConfigError(f"--rtt-ms {args.rtt_ms:g}: a delay is 0 ms or more")


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


def progress(line: str) -> None:
    print(f"[bench wan electra] {line}", file=sys.stderr, flush=True)


def stage_named(raw: dict, impl: str) -> str:
    return next(name for name, stage in raw["stages"].items() if stage["impl"] == impl)


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


def measure(run: Path, raw: dict, rate: float | None, rtt_ms: float, label: str, lab: Lab) -> dict:
    """Runs the job (over a fresh shaped link with `rtt_ms` of delay, unless `rate` is None: one site)
    and sums its generator's timed steps, with the discriminator's compute over the same steps."""
    gen, disc = stage_named(raw, "electra-generator"), stage_named(raw, "electra-discriminator")
    steps = raw["train"]["steps"]
    shutil.rmtree(run, ignore_errors=True)  # run_job does too, but the counter must not read a kept run's records
    if rate is None:
        lab.run_job(run, raw, label=label)
        snapshots: list[tuple[int, int]] = []
    else:
        sites = tuple(dict.fromkeys(stage["address"].split("/")[0] for stage in raw["stages"].values()))
        with lab.emulated_wan(name_prefix=f"nbe{os.getpid()}", rate_mbit=rate, sites=sites, rtt_ms=rtt_ms) as link:
            with LinkCounter(link, run / gen / "metrics.jsonl", WARMUP, steps - 1) as counter:
                lab.run_job(run, raw, wan=link, label=label)
        snapshots = counter.snapshots
    sums = step_sums(read_records(run / gen / "metrics.jsonl"), snapshots, label)
    sums["disc_compute_s"] = sum(r["compute_s"] for r in read_records(run / disc / "metrics.jsonl")[WARMUP:-1])
    return sums


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
    return {"runs": sums["runs"], "timed_steps": sums["steps"],
            "throughput": round(sums["tokens"] / sums["seconds"], 1),
            "sequences_per_step": round(sums["sequences"] / sums["steps"], 1),
            "step_s": round(sums["seconds"] / sums["steps"], 4),
            "generator_busy": round(sums["compute_s"] / sums["seconds"], 3),
            "generator_compute_s": round(sums["compute_s"] / sums["steps"], 4),
            "generator_wait_ms": round(1000 * (sums["seconds"] - sums["compute_s"]) / sums["steps"], 1),
            "disc_compute_s": round(sums.get("disc_compute_s", 0.0) / sums["steps"], 4),
            "generator_ms_per_sequence": round(1000 * sums["compute_s"] / sums["sequences"], 2),
            "bytes_per_token": round(sums["payload_bytes"] / sums["tokens"], 3),
            "link_bytes_per_token": None if link is None or not sums["link_tokens"]
            else round(link / sums["link_tokens"], 3)}


SCENARIO = ElectraScenario()
