"""`nebula bench wan --auto --change`: `compression = "auto"` while the link's rate changes under it.

One training run of the scenario's job, `compression = "auto"` both ways on the benchmarked link,
over the emulated WAN with `--rtt-ms` (default 80). The link starts at 60 Mbit/s; each time every
stage has finished a segment of `--steps` steps (default SEGMENT), its rate changes under the running
transfers (WanLink.set_rate: tbf changed in place, the connections kept): to the communication-bound
rate, calibrated from the first segment (where `auto` stays lossless) so that uncompressed wire =
`--bound-factor` x compute, then to a quarter of it, then back to 60 Mbit/s.

Per segment, from the stages' own metrics: the step after which the rate changed; each `compression`
event in it (the sender's: step, direction, old -> new, trial); per direction, how many steps after
the change `auto` first moved and when it last moved (settled); the rung in force over the segment's
last TAIL steps, their s/step, the larger site's compute and the wire of their bytes at the rate, and
`to_limit` = s/step / max(compute, wire): 1.0 is a step at its physical limit, the larger of the two;
and `tcp_cc`, the congestion control of the links' TCP connections: it decides how soon a connection
that carried little while the link was slow uses the link again once it is fast (docs/bench-wan.md,
"The link changes under `auto`").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from nebula.codecs.auto import EVERY
from nebula.errors import ConfigError
from nebula.runtime.records import read_records
from nebula_lab.bench import wan
from nebula_lab.bench.wan_auto import LOWER, RTT_MS
from nebula_lab.wanem import WanLink

SEGMENT = 30  # steps per rate: back up five rungs takes a trial a rung, after up to 16 steps of a failed one's wait
TAIL = 6  # the segment's last steps, timed: the rung `auto` settled on
# What the bench promises: a slower link is acted on at auto's next look once the ACKs of a step show
# it (every + 2 steps); a faster one is climbed a rung per trial (a step or two each) from the next look.
SLOWER_WITHIN = EVERY + 2
# The go-back-N timer must outlast the deepest queue, the uncompressed step in flight when the link drops
# to the bound rate: bound-factor (5) x compute (~1 s) of wire; wan.resend_timeout allows 3 such steps.
RESEND_S = 30.0


def run_change(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("nebula bench wan --auto --change: skipped: the emulated WAN link needs root", file=sys.stderr)
        return 2
    rtt = RTT_MS if args.rtt_ms is None else args.rtt_ms
    segment = args.steps or SEGMENT
    if segment <= TAIL + SLOWER_WITHIN:
        raise ConfigError(f"--steps {segment}: a segment needs more than {TAIL + SLOWER_WITHIN} steps "
                          f"(time to move, then {TAIL} timed steps)")
    with wan._workdir(args.workdir) as work:
        rows = measure(args, work / "change", segment, rtt)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(rows, rtt)
    return 0


def measure(args: argparse.Namespace, run, segment: int, rtt: float) -> list[dict]:
    job = wan.bench_job(args, [("auto", "auto")], 4 * segment - 1, run.parent)
    ends = [wan.LEAD_IN + k * segment for k in range(1, 5)]  # the last step of each segment
    rates, changes = [wan.PAPER_MBIT], []  # (after step, rate)
    sites = tuple(dict.fromkeys(stage["address"].split("/")[0] for stage in job["stages"].values()))

    def watch(done: int) -> None:
        if len(changes) == 3 or done < ends[len(changes)]:
            return
        if not changes:  # calibrate on the lossless first segment's tail
            tail = window(run, job, range(ends[0] - TAIL + 1, ends[0] + 1), rates[0])
            wire_mbit = max(tail["forward_mb"], tail["backward_mb"]) * 8
            bound = float(f"{wire_mbit / (args.bound_factor * tail['compute_s']):.3g}")
            rates.extend([bound, float(f"{bound / LOWER:.3g}"), wan.PAPER_MBIT])
        link.set_rate(rates[len(changes) + 1])
        changes.append(done)
        wan.progress(f"after step {done}: the link is now {link.rate_mbit:g} Mbit/s")

    wan.progress(f"rate changes: 60 Mbit/s, then the bound rate, / {LOWER:g}, 60 again; {segment} steps each, "
                 f"RTT {rtt:g} ms")
    with WanLink(name_prefix=f"nbc{os.getpid()}", rate_mbit=rates[0], sites=sites, rtt_ms=rtt) as link:
        wan.run_job(run, job, wan=link, label="rate changes", watch=watch, channel={"resend_timeout": RESEND_S})
        tcp_cc = link.run(sites[0], ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], capture_output=True,
                          text=True).stdout.strip() or None
    return [dict(row, tcp_cc=tcp_cc) for row in summarise(run, job, rates, [0, *changes], ends, rtt)]


def window(run, job: dict, steps: range, rate: float) -> dict:
    """Over `steps`: the driver's s/step, the larger site's compute, the wire bytes each way on the
    benchmarked link and their time at `rate`, and the codecs `auto` chose each way (the tensors it
    chooses for: ids and masks always go as they are)."""
    stages = {name: stage["address"].split("/")[0] for name, stage in job["stages"].items()}
    driver, link = next(iter(stages)), job["bench"]["link"]
    src, dst = link.split("->")
    metrics = {name: {r["step"]: r for r in read_records(run / name / "metrics.jsonl")} for name in stages}
    compute = max(statistics.fmean(sum(metrics[n][s]["compute_s"] for n in stages if stages[n] == site) for s in steps)
                  for site in set(stages.values()))
    out = {"s_per_step": statistics.fmean(metrics[driver][s]["step_s"] for s in steps), "compute_s": compute}
    for stage, direction in ((src, "forward"), (dst, "backward")):
        sums = wan.per_step_link(run / stage / "link.jsonl", direction, link)
        out[f"{direction}_mb"] = statistics.fmean(sums.get(s, {"wire": 0})["wire"] for s in steps) / 1e6
        out[f"{direction}_codecs"] = list(dict.fromkeys(
            r["codec"] for r in read_records(run / stage / "link.jsonl", kind=None)
            if r.get("auto") and r.get("dir") == direction and r.get("link") == link and r.get("step") in steps))
    out["wire_s"] = max(out["forward_mb"], out["backward_mb"]) * 8 / rate
    return out


def summarise(run, job: dict, rates: list[float], after: list[int], ends: list[int], rtt: float) -> list[dict]:
    link = job["bench"]["link"]
    src, dst = link.split("->")
    events = sorted((r for stage in (src, dst) for r in read_records(run / stage / "metrics.jsonl", kind="event")
                     if r.get("event") == "compression" and r.get("link") == link), key=lambda r: (r["step"], r["dir"]))
    rows = []
    for k, rate in enumerate(rates):
        moves = [e for e in events if after[k] < e["step"] <= ends[k]]
        tail = window(run, job, range(ends[k] - TAIL + 1, ends[k] + 1), rate)
        row = {"segment": k + 1, "link_mbit": rate, "rtt_ms": rtt, "after_step": after[k], "last_step": ends[k],
               "moves": [{"step": e["step"], "dir": e["dir"], "old": e["old"], "new": e["new"], "trial": e["trial"],
                          "goodput_mbit": e["goodput_mbit"]} for e in moves],
               **{k2: round(v, 4) if isinstance(v, float) else v for k2, v in tail.items()}}
        for direction in ("forward", "backward"):
            mine = [e["step"] - after[k] for e in moves if e["dir"] == direction]
            row[f"{direction}_first_move"] = mine[0] if mine else None
            row[f"{direction}_settled"] = mine[-1] if mine else 0
        row["to_limit"] = round(tail["s_per_step"] / max(tail["compute_s"], tail["wire_s"]), 3)
        row["lossless"] = all(c == "none" for d in ("forward", "backward") for c in tail[f"{d}_codecs"])
        rows.append(row)
    return rows


def print_rows(rows: list[dict], rtt: float) -> None:
    print(f"auto while the link changes (RTT {rtt:g} ms, TCP congestion control {rows[0]['tcp_cc']}): per segment, "
          f"the steps after the change until each direction first moved and last moved, and its last {TAIL} steps: "
          "the rungs in force, s/step, compute, wire at the rate, s/step / max(compute, wire)")
    print(f"{'segment':>8}{'Mbit/s':>8}{'after':>7}  {'fwd first/last':>15}{'bwd first/last':>15}  "
          f"{'forward':<22}{'backward':<22}{'s/step':>8}{'compute':>9}{'wire':>7}{'to limit':>10}")
    for r in rows:
        moved = {d: f"{r[f'{d}_first_move'] if r[f'{d}_first_move'] is not None else '-'}/{r[f'{d}_settled']}"
                 for d in ("forward", "backward")}
        print(f"{r['segment']:>8}{r['link_mbit']:>8.3g}{r['after_step']:>7}  "
              f"{moved['forward']:>15}{moved['backward']:>15}  "
              f"{','.join(r['forward_codecs']):<22}{','.join(r['backward_codecs']):<22}{r['s_per_step']:>8.2f}"
              f"{r['compute_s']:>9.2f}{r['wire_s']:>7.2f}{r['to_limit']:>10.2f}")
    for r in rows:
        for m in r["moves"]:
            print(f"  segment {r['segment']}: step {m['step']} {m['dir']} {m['old']} -> {m['new']}"
                  f"{' (trial)' if m['trial'] else ''} at {m['goodput_mbit']} Mbit/s measured")
