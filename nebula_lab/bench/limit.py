"""The limit of a pipeline step: what no schedule can beat on the resources a run had.

Every resource of a step is busy for some time: each stage for its compute, each link direction for
its bytes / rate. A step can be no shorter than the busiest one. A schedule that drains the pipeline
every step (nebula.runtime.schedules: `drains`, as synchronous, gpipe and 1f1b do) also pays one fill:
before the busiest resource gets its first micro-batch and after it has done its last, one micro-batch
must cross everything else on its round trip (the stages' compute of one micro-batch, each link
direction's bytes of one micro-batch, and the propagation delay, RTT / 2 per link and direction).

    limit = max over resources of busy time  +  (drains: the round trip of one micro-batch, without the
                                                 busiest resource's share of it)

For uniform compute-only stages this is GPipe's (m + S - 1) x t: busiest m x t, fill (S - 1) x t. A
row reads as `limit_s / step_s`, the fraction of the ideal it reaches (1.0: no schedule could do better).
"""
from __future__ import annotations

from typing import Mapping


def round_trip(graph, stage: str, compute: Mapping[str, float], wire: Mapping[tuple[str, str], float],
               micro_batches: int, rtt_s: float) -> float:
    """One micro-batch from `stage` to the end of its longest path and, on two-way links, back: seconds."""
    own = compute[stage] / micro_batches
    paths = []
    for link in graph.out_links[stage]:
        there = wire.get((link.name, "forward"), 0.0) / micro_batches + rtt_s / 2
        back = wire.get((link.name, "backward"), 0.0) / micro_batches + rtt_s / 2 if link.backward else 0.0
        paths.append(there + round_trip(graph, link.dst, compute, wire, micro_batches, rtt_s) + back)
    return own + max(paths, default=0.0)


def limit(graph, compute: Mapping[str, float], wire: Mapping[tuple[str, str], float], micro_batches: int,
          rtt_s: float, drains: bool) -> dict:
    """`compute`: stage -> compute seconds per step; `wire`: (link, direction) -> seconds per step of its
    bytes at the link rate. -> {limit_s, busiest, busy_s, fill_s}."""
    busy = {**{f"stage {s}": c for s, c in compute.items()},
            **{f"{link} {direction}": w for (link, direction), w in wire.items()}}
    busiest = max(busy, key=lambda k: busy[k])
    fill = 0.0
    if drains:
        trip = max(round_trip(graph, s, compute, wire, micro_batches, rtt_s) for s in graph.sources)
        fill = trip - busy[busiest] / micro_batches
    return {"limit_s": busy[busiest] + fill, "busiest": busiest, "busy_s": busy[busiest], "fill_s": fill}
