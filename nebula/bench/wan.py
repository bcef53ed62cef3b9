"""`nebula bench wan --scenario abnet`: the paper's Table 5 (compression vs speed) on the emulated WAN.

Both sites run as real services inside their own network namespace (nebula.wanem): site a's gateway
and the ABNet encoder in one, site b's gateway and decoder in the other, the gateways joined by a
tbf-shaped veth pair. One training run per link rate measures every setting: the job's
[compression] holds one *phase* per setting (nebula.runtime.link), so the ~10 s model load is paid
once per rate, not once per setting. The first step of each phase is not timed (codec warm-up, and
the pipeline still draining the previous phase), nor is the run's last step (final checkpoint).

Rates: the paper's 60 Mbit/s, then a communication-bound rate computed from the 60 Mbit/s run's
uncompressed phase so that uncompressed wire time per step ~= 5x compute time per step (the paper's
regime: 4.42 s/step uncompressed vs 0.86 s/step at its strongest compression).

Per row (all from the stages' own metrics: metrics.jsonl and link.jsonl of each stage):
- forward_ratio / backward_ratio: wire bytes / raw bytes of the tensors sent in that direction;
- s_per_step: mean time between the head's optimizer steps (with staleness 0 that is one step's
  forward of all micro-batches to its update);
- speedup: uncompressed s_per_step / this row's, same run;
- overlap_ratio: s_per_step / max(compute, wire), compute = the larger site's compute per step,
  wire = max over the two directions of wire bytes per step / link rate (the link is full duplex).
Quality (BLEU, loss curves; --quality) is in nebula/bench/wan_quality.py.
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
import tomllib
from pathlib import Path

from nebula.runtime.metrics import read_records

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = {"abnet": ROOT / "deploy" / "jobs" / "abnet-es-en.toml"}
PAPER_MBIT = 60.0
BOUND_FACTOR = 5.0  # uncompressed wire time / compute time in the communication-bound regime
HIDDEN = 384  # width of the boundary tensor H_E (multilingual-e5-small)
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
                                        "(root), or BLEU per setting with --quality")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="abnet", help="which job (default abnet)")
    parser.add_argument("--job", type=Path, default=None,
                        help="use this job file instead of the scenario's (e.g. all the training data, "
                             "another objective)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    parser.add_argument("--quick", action="store_true", help="4 settings, fewer steps (a few minutes)")
    parser.add_argument("--quality", action="store_true",
                        help="train each setting from the same start, report BLEU, plot loss curves (no WAN needed)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per setting (speed; default 3, quick 2) or training steps per setting "
                             "(quality; default 300, quick 20)")
    parser.add_argument("--micro-batches", type=int, default=None, help="override the job's [train].micro_batches")
    parser.add_argument("--setting", nargs=2, action="append", metavar=("FORWARD", "BACKWARD"),
                        help="measure this codec pair instead of the built-in list (repeatable; the first is "
                             "the baseline of `speedup`), e.g. --setting none none --setting fp16 int8")
    parser.add_argument("--staleness", type=int, choices=(0, 1), default=None,
                        help="override the job's [train].staleness: 0 synchronous steps (the paper's), "
                             "1 the head runs one step ahead (no per-step pipeline bubble)")
    parser.add_argument("--seed", type=int, default=None,
                        help="override the job's [train].seed (initialisation, dropout and example order)")
    parser.add_argument("--bound-factor", type=float, default=BOUND_FACTOR,
                        help="uncompressed wire time / compute time at the communication-bound rate (default 5)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="--quality: where the loss-curve PNG goes (default: WORKDIR/loss.png, "
                             "or runs/bench-wan-loss.png without --workdir)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep logs, metrics and plots here (default: a temporary directory, removed)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quality:
        from nebula.bench.wan_quality import run_quality
        return run_quality(args)
    if os.geteuid() != 0:
        print("nebula bench wan: skipped: the emulated WAN link needs root (network namespaces and tc); "
              "run as root, or use --quality, which needs no link", file=sys.stderr)
        return 2
    settings = chosen_settings(args)
    timed = args.steps or (2 if args.quick else 3)
    with _workdir(args.workdir) as work:
        from nebula.runtime.job import load_job
        data = fixed_shape_corpus(Path(load_job(chosen_job(args)).data), work / "data")
        job = bench_job(chosen_job(args), settings, timed, data, args)
        rows = measure_rate(work / "60mbit", job, PAPER_MBIT)
        rate = bound_rate(rows[0], args.bound_factor)
        progress(f"communication-bound rate: {rate} Mbit/s (uncompressed wire = {args.bound_factor:g} x compute)")
        rows += measure_rate(work / "bound", job, rate)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
        print_verdict(rows, args.bound_factor)
    return 0


def chosen_job(args: argparse.Namespace) -> Path:
    return args.job or SCENARIOS[args.scenario]


def chosen_settings(args: argparse.Namespace) -> list[tuple[str, str]]:
    if not args.setting:
        return QUICK_SETTINGS if args.quick else SETTINGS
    from nebula.runtime.link import parse_phases
    pairs = [tuple(pair) for pair in args.setting]
    parse_phases({"phases": [{"steps": 1, "forward": f, "backward": b} for f, b in pairs]}, "--setting")
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
def bench_job(job_file: Path, settings: list[tuple[str, str]], timed: int, data: Path,
              args: argparse.Namespace) -> dict:
    """The scenario's job on `data`, one compression phase per setting (1 untimed + `timed` steps each;
    the first phase has LEAD_IN more untimed steps)."""
    raw = tomllib.loads(job_file.read_text())
    per_phase = 1 + timed
    total = per_phase * len(settings) + LEAD_IN + 1  # + the final step, which also saves the last checkpoint
    raw["job"]["data"] = str(data)  # absolute: the bench job file lives elsewhere
    raw["train"].update(steps=total, checkpoint_every=total, log_every=total)
    override_train(raw, args)
    for stage in raw["stages"].values():  # load only the examples the run uses; no test-set decoding
        stage.update(max_train_examples=total * raw["train"].get("batch_size", 32), eval_examples=0)
    phases = [{"steps": per_phase, "forward": f, "backward": b} for f, b in settings]
    phases[0]["steps"] += LEAD_IN
    phases[-1]["steps"] += 1
    raw["compression"] = {"phases": phases}
    return raw


def override_train(raw: dict, args: argparse.Namespace) -> None:
    """--micro-batches, --staleness, --seed: the job's [train] values unless given."""
    for key in ("micro_batches", "staleness", "seed"):
        if getattr(args, key, None) is not None:
            raw["train"][key] = getattr(args, key)


def fixed_shape_corpus(data: Path, out: Path, min_words: int = 30) -> Path:
    """The job's corpus with only long training pairs (>= min_words words on both sides): truncated to
    [train].max_len tokens, every micro-batch of every step is (B/M, max_len, H), so each phase
    moves the same bytes and does the same compute, as the paper's fixed-length batches do.
    Validation and test stay whole (the vocabulary cut is built from every split)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = {ext: (data / f"train.{ext}").read_text().splitlines() for ext in ("src", "tgt", "ids")}
    keep = [i for i, (s, t) in enumerate(zip(lines["src"], lines["tgt"]))
            if len(s.split()) >= min_words and len(t.split()) >= min_words]
    for ext, rows in lines.items():
        (out / f"train.{ext}").write_text("".join(rows[i] + "\n" for i in keep))
    for split in ("valid", "test"):
        for ext in ("src", "tgt", "ids"):
            target = out / f"{split}.{ext}"
            if not target.exists():
                target.symlink_to(data / f"{split}.{ext}")
    return out


def write_toml(table: dict, path: Path) -> None:
    """Minimal TOML for job tables: [section] / [section.sub] of scalars, lists of inline tables."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a valid TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {v!r} as TOML")

    lines: list[str] = []

    def section(name: str, body: dict) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for k, v in body.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    for name, body in table.items():
        section(name, body)
    path.write_text("\n".join(lines) + "\n")


def phase_steps(job: dict) -> list[tuple[dict, list[int]]]:
    """(phase, timed steps) for each phase: all but its first step (the run's first 1 + LEAD_IN) and
    the run's last step."""
    out, first, last = [], 1, job["train"]["steps"]
    for i, phase in enumerate(job["compression"]["phases"]):
        steps = [s for s in range(first + 1 + (LEAD_IN if i == 0 else 0), first + phase["steps"]) if s != last]
        out.append((phase, steps))
        first += phase["steps"]
    return out


# --- one run over the shaped link ---------------------------------------------------------------------
def measure_rate(run: Path, job: dict, rate_mbit: float) -> list[dict]:
    from nebula.wanem import WanLink

    progress(f"{rate_mbit} Mbit/s: {job['train']['steps']} steps, {len(job['compression']['phases'])} settings")
    with WanLink(name_prefix=f"nbw{os.getpid()}", rate_mbit=rate_mbit) as link:
        run_job(run, job, hosts={s: link.address(s) for s in "ab"}, prefixes={s: link.exec_prefix(s) for s in "ab"},
                label=f"{rate_mbit} Mbit/s", channel={"resend_timeout": resend_timeout(job, rate_mbit)})
        qdisc = {site: st["qdisc"] for site, st in link.status().items()}
    progress(f"{rate_mbit} Mbit/s: link bytes a->b {qdisc['a']['bytes']}, b->a {qdisc['b']['bytes']} (all frames, "
             f"whole run), tbf drops a {qdisc['a']['drops']}, b {qdisc['b']['drops']}")
    (run / "qdisc.json").write_text(json.dumps(qdisc, indent=1))
    return summarise(run, job, rate_mbit)


def resend_timeout(job: dict, rate_mbit: float) -> float:
    """An ACK crosses the link behind whatever the other direction has queued: up to a whole step of
    uncompressed tensors. With the default 5 s go-back-N timer, a link below ~1 Mbit/s resent every
    message of a step (measured: an 18 s step instead of 10.8 s); allow three steps' worth of wire."""
    train = job["train"]
    step_bytes = train.get("batch_size", 32) * train.get("max_len", 32) * HIDDEN * 4  # (B, S, H) float32
    return round(max(5.0, 3 * step_bytes * 8 / (rate_mbit * 1e6)), 1)


def run_job(run: Path, job: dict, label: str, hosts: dict | None = None, prefixes: dict | None = None,
            channel: dict | None = None, timeout_s: float | None = None) -> None:
    """Starts both sites' gateways and stages, waits until both stages have finished, stops all."""
    from nebula.errors import StageError
    from nebula.launch import start_sites

    shutil.rmtree(run, ignore_errors=True)  # a kept --workdir from an earlier run: start clean
    run.mkdir(parents=True)
    job_file = run / "job.toml"
    write_toml(job, job_file)
    stages = {name: stage["address"] for name, stage in job["stages"].items()}
    head, tail = list(stages)
    timeout_s = timeout_s or 300 + 60 * job["train"]["steps"]
    group = start_sites(run, job_file, stages, hosts=hosts, prefixes=prefixes, restart=False, channel=channel)
    started, shown = time.monotonic(), 0
    try:
        while not all(group.services[n].proc.poll() == 0 for n in (head, tail)):
            group.poll()  # raises StageError, with the log tail, if anything failed
            if time.monotonic() - started > timeout_s:
                raise StageError(f"{label}: the job did not finish in {timeout_s:.0f} s; logs in {run / 'logs'}")
            done = len(read_records(run / tail / "metrics.jsonl"))
            if done > shown:
                progress(f"{label}: step {done}/{job['train']['steps']} ({time.monotonic() - started:.0f} s)")
                shown = done
            time.sleep(0.5)
    finally:
        group.stop()


def per_step_link(path: Path, direction: str) -> dict[int, dict]:
    """step -> summed raw bytes, wire bytes and encode seconds of the tensors sent that step, and the
    first and last time one was packed (host clock, shared by both sites' processes)."""
    sums: dict[int, dict] = {}
    for r in read_records(path, kind=None):
        if r.get("dir") == direction:
            s = sums.setdefault(r["step"], {"raw": 0, "wire": 0, "encode_s": 0.0, "first": r["t"], "last": r["t"]})
            s["raw"], s["wire"], s["encode_s"] = s["raw"] + r["raw"], s["wire"] + r["wire"], s["encode_s"] + r["encode_s"]
            s["first"], s["last"] = min(s["first"], r["t"]), max(s["last"], r["t"])
    return sums


def fill(head: dict, bwd: dict) -> float:
    """Pipeline fill: step start at the head to the tail's first gradient (head forward of micro-batch
    0, its encode and forward wire, tail compute of micro-batch 0). After it, a step needs at least the
    backward wire time; what remains beyond both is the drain (head backward of the last micro-batch,
    optimizer) and any time the backward direction sat idle waiting for forward data or compute."""
    return bwd["first"] - (head["t"] - head["step_s"])


def summarise(run: Path, job: dict, rate_mbit: float) -> list[dict]:
    head, tail = list(job["stages"])
    hm = {r["step"]: r for r in read_records(run / head / "metrics.jsonl")}
    tm = {r["step"]: r for r in read_records(run / tail / "metrics.jsonl")}
    fwd = per_step_link(run / head / "link.jsonl", "forward")
    bwd = per_step_link(run / tail / "link.jsonl", "backward")
    rows, stale = [], int(job["train"].get("staleness", 0))
    for phase, steps in phase_steps(job):
        def mean(values) -> float:
            return statistics.fmean(values)
        step_s = mean(hm[s]["step_s"] for s in steps)
        compute_a, compute_b = mean(hm[s]["compute_s"] for s in steps), mean(tm[s]["compute_s"] for s in steps)
        fwd_wire, bwd_wire = mean(fwd[s]["wire"] for s in steps), mean(bwd[s]["wire"] for s in steps)
        wire_s = max(fwd_wire, bwd_wire) * 8 / (rate_mbit * 1e6)
        row = {
            "forward": phase["forward"], "backward": phase["backward"], "link_mbit": rate_mbit, "staleness": stale,
            "s_per_step": round(step_s, 3), "speedup": None,
            "overlap_ratio": round(step_s / max(compute_a, compute_b, wire_s), 3),
            "forward_ratio": round(sum(fwd[s]["wire"] for s in steps) / sum(fwd[s]["raw"] for s in steps), 4),
            "backward_ratio": round(sum(bwd[s]["wire"] for s in steps) / sum(bwd[s]["raw"] for s in steps), 4),
            "compute_a_s": round(compute_a, 3), "compute_b_s": round(compute_b, 3), "wire_s": round(wire_s, 3),
            "forward_mb": round(fwd_wire / 1e6, 4), "backward_mb": round(bwd_wire / 1e6, 4),
            "encode_a_s": round(mean(fwd[s]["encode_s"] for s in steps), 4),
            "encode_b_s": round(mean(bwd[s]["encode_s"] for s in steps), 4),
            "bwd_wire_s": round(bwd_wire * 8 / (rate_mbit * 1e6), 3), "fill_s": None, "rest_s": None,
            "timed_steps": len(steps)}
        if not stale:  # one step's anatomy; with staleness 1 the steps overlap, so it has no meaning
            row["fill_s"] = round(mean(fill(hm[s], bwd[s]) for s in steps), 3)
            row["rest_s"] = round(step_s - row["fill_s"] - row["bwd_wire_s"], 3)
        rows.append(row)
    base = rows[0]["s_per_step"]
    for row in rows:
        row["speedup"] = round(base / row["s_per_step"], 3)
    return rows


def bound_rate(uncompressed: dict, factor: float) -> float:
    """Link rate (Mbit/s) at which uncompressed wire time per step = factor x compute time per step."""
    compute = max(uncompressed["compute_a_s"], uncompressed["compute_b_s"])
    megabytes = max(uncompressed["forward_mb"], uncompressed["backward_mb"])
    return float(f"{megabytes * 8 / (factor * compute):.3g}")


# --- output --------------------------------------------------------------------------------------------
COLUMNS = [("forward", "forward", 20, "s"), ("backward", "backward", 9, "s"), ("Mbit/s", "link_mbit", 8, ".3g"),
           ("fwd ratio", "forward_ratio", 10, ".3f"), ("bwd ratio", "backward_ratio", 10, ".3f"),
           ("s/step", "s_per_step", 8, ".2f"), ("speedup", "speedup", 8, ".2f"),
           ("overlap", "overlap_ratio", 8, ".2f"), ("comp a", "compute_a_s", 7, ".2f"),
           ("comp b", "compute_b_s", 7, ".2f"), ("wire", "wire_s", 7, ".2f"),
           ("enc a", "encode_a_s", 7, ".3f"), ("enc b", "encode_b_s", 7, ".3f"),
           ("fill", "fill_s", 6, ".2f"), ("bwire", "bwd_wire_s", 6, ".2f"), ("rest", "rest_s", 6, ".2f")]


def print_table(rows: list[dict]) -> None:
    print("".join(f"{title:<{w}}" if fmt == "s" else f"{title:>{w}}" for title, _, w, fmt in COLUMNS))
    for i, row in enumerate(rows):
        if i and row["link_mbit"] != rows[i - 1]["link_mbit"]:
            print()
        print("".join(f"{row[key]:<{w}}" if fmt == "s" else f"{'-':>{w}}" if row[key] is None
                      else f"{row[key]:>{w}{fmt}}" for _, key, w, fmt in COLUMNS))
    print(f"(staleness {rows[0]['staleness']}; seconds per step; comp a/b: each site's compute; "
          "wire: max direction bytes / link rate;\n enc a/b: codec encode time on each site's sender thread; "
          "fill: step start -> first gradient sent by b;\n bwire: backward bytes / link rate; "
          "rest = s/step - fill - bwire; fill and rest only for synchronous steps)")


def print_verdict(rows: list[dict], factor: float) -> None:
    bound = [r for r in rows if r["link_mbit"] == rows[-1]["link_mbit"]]
    best = max(bound[1:], key=lambda r: r["speedup"])
    print(f"\ncommunication-bound ({bound[0]['link_mbit']} Mbit/s, uncompressed wire {factor:g} x compute): "
          f"best {best['forward']} + {best['backward']}: speedup {best['speedup']:.2f}x "
          f"({'met' if best['speedup'] >= 4 else 'NOT met'}, target >= 4), overlap ratio {best['overlap_ratio']:.2f} "
          f"({'met' if best['overlap_ratio'] <= 1.10 else 'NOT met'}, target <= 1.10)")
