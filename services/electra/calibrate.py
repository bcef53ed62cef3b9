"""How many sub-discriminators a generator needs (paper §3.3), from a warm-up on this machine.

Each generator feeding the discriminator and one rank of the discriminator run a few real
micro-batches in this process: t_G, a generator's time per micro-batch (forward, its own MLM
backward, its share of the optimiser step) and t_D, one sub's (forward and backward, with any
compute throttle). The generators run in parallel at their own sites, so the discriminator gets
one micro-batch from each every t_G_i; n subs keep up when n / t_D >= sum_i 1 / t_G_i.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nebula.runtime.job import JobConfig
from nebula.runtime.order import id_hashes
from nebula.runtime.service import build_stage
from nebula.runtime.stage import Batch, Stage, finished

WARMUP, TIMED = 1, 3  # micro-batches: the first pays for allocations and is not counted


def measure(job: JobConfig, name: str, most: int) -> tuple[int, dict[str, Any]]:
    per_micro = max(1, job.train.batch_size // job.train.micro_batches)
    sources = [link.src for link in job.graph.in_links[name]]
    cores = os.sched_getaffinity(0)  # a stage with `cpus` pins the process that builds it: this one, here
    try:
        with tempfile.TemporaryDirectory(prefix="nebula-calibrate-") as tmp:
            disc = build_stage(job, name, Path(tmp) / name, quiet=True)
            t_gen, t_sub = {}, []
            for source in sources:
                # each build may pin this process to its stage's `cpus`: give the next one every core back
                os.sched_setaffinity(0, cores)
                gen = build_stage(job, source, Path(tmp) / source, quiet=True)
                times, outputs = _time_generator(gen, per_micro, job.train.micro_batches)
                t_gen[source] = statistics.median(times)
                t_sub += _time_discriminator(disc, outputs, f"{source}->{name}")
    finally:
        os.sched_setaffinity(0, cores)
    rate = sum(1 / t for t in t_gen.values())  # generators' micro-batches per second, together
    t_d = statistics.median(t_sub)
    n = auto_subs(1 / rate, t_d, most)
    return n, {"t_generator_s": {k: round(v, 4) for k, v in t_gen.items()}, "t_sub_s": round(t_d, 4),
               "most": most, "micro_batch": per_micro}


def _time_generator(gen: Stage, size: int, micro_batches: int) -> tuple[list[float], list[tuple[Batch, dict]]]:
    ids = gen.examples("train")
    times, outputs = [], []
    for k in range(WARMUP + TIMED):
        indices = [(k * size + i) * 7919 % len(ids) for i in range(size)]
        batch = Batch("train", 1, k, ids=id_hashes([ids[i] for i in indices]), indices=indices)
        t0 = time.perf_counter()
        gen.module.train(True)
        out = gen.forward(batch, {})
        (out.loss / micro_batches).backward()
        if (k + 1) % micro_batches == 0:
            gen.optimizer.step()
            gen.optimizer.zero_grad()
        finished(gen.device)
        if k >= WARMUP:
            times.append(time.perf_counter() - t0)
        outputs.append((batch, {n: t.detach() for n, t in out.tensors.items()}))
    return times, outputs


def _time_discriminator(disc: Stage, outputs: list[tuple[Batch, dict]], link: str) -> list[float]:
    times = []
    for k, (batch, inputs) in enumerate(outputs):
        t0 = time.perf_counter()
        disc.module.train(True)
        disc.forward(Batch("train", 1, k, ids=batch.ids, link=link), inputs).loss.backward()
        finished(disc.device)
        if k >= WARMUP:
            times.append(time.perf_counter() - t0)
    disc.optimizer.zero_grad()
    return times


# n within [LOW x r, HIGH x r] of the measured ratio r = t_sub / t_G: below, G waits for D more than 10% of
# its time; above, each sub is busy less than 85% of it (throughput per sub below 0.85)
LOW, HIGH = 0.9, 1 / 0.85


def auto_subs(t_generator: float, t_sub: float, most: int) -> int:
    """n of paper §3.3: sub-discriminators enough that they consume G's micro-batches as fast as G makes
    them. The band's largest n: r comes from one sub's time, and the step grows with n (the scatter, the
    all-reduce barrier: 10-15% from n = 1 to 8 in Table 4), so ceil(r) left G waiting ~10%; at the band's
    top every sub is still busy >= 85% of its time by the ratio. Where the band holds no integer (a small
    r), the nearest to r."""
    r = t_sub / max(t_generator, 1e-9)
    low, high = math.ceil(LOW * r), math.floor(HIGH * r)
    n = high if low <= high else round(r)
    return max(1, min(most, n))
