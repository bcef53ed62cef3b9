"""Host CPU seconds of a benchmark's processes, by kind, read from /proc while the job runs.

The stages' metrics time their own compute; what moving the bytes costs the host (the CURVE
gateways, and on an emulated link with a delay the user-space delay lines) shows nowhere else. On
2 shared cores that cost competes with training, so the bench reports it per phase: CPU seconds per
step of each kind over the phase's timed steps.

A sampler thread reads utime + stime of the given processes every INTERVAL_S and appends, per
sample, each kind's cumulative CPU (a process that has exited keeps its last reading), so a phase's
cost is the difference of two samples: exact to about INTERVAL_S of CPU at either end of a window.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nebula.site.process import cpu_ticks

INTERVAL_S = 0.2
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of process `pid` in seconds; None if it is gone."""
    ticks = cpu_ticks(pid)
    return None if ticks is None else ticks / TICKS


class CpuSampler:
    """`with CpuSampler(path, processes):` samples `processes()` ({pid: kind}, asked at every sample,
    so processes started later are counted) into `path`, one JSON line per sample."""

    def __init__(self, path: Path, processes: Callable[[], dict[int, str]], interval_s: float = INTERVAL_S):
        self.path, self.processes, self.interval_s = Path(path), processes, interval_s
        self.last: dict[int, tuple[str, float]] = {}  # pid -> (kind, last CPU seconds read)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._out = open(self.path, "a", encoding="utf-8")
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the end of the last window
        self._out.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        self._out.write(json.dumps({"t": time.time(), "cpu": self.read()}) + "\n")
        self._out.flush()

    def read(self) -> dict[str, float]:
        """Each kind's CPU seconds so far, the exited processes' last readings included."""
        for pid, kind in self.processes().items():
            seconds = cpu_seconds(pid)
            if seconds is not None:
                self.last[pid] = (kind, seconds)
        totals: dict[str, float] = {}
        for kind, seconds in self.last.values():
            totals[kind] = totals.get(kind, 0.0) + seconds
        return totals


def read_samples(path: Path) -> list[dict]:
    """The samples a CpuSampler wrote, oldest first; [] if it wrote none."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def per_step(samples: list[dict], start: float, end: float, steps: int) -> dict[str, float] | None:
    """Each kind's CPU seconds per step between wall times `start` and `end` (the last sample at or
    before each); None if the samples do not cover the window."""
    before = [s for s in samples if s["t"] <= start]
    after = [s for s in samples if s["t"] <= end]
    if not before or not after or after[-1]["t"] <= before[-1]["t"] or steps < 1:
        return None
    a, b = before[-1]["cpu"], after[-1]["cpu"]
    return {kind: round((b[kind] - a.get(kind, 0.0)) / steps, 4) for kind in sorted(b)}
