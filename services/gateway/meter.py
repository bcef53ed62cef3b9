"""Byte and message counters of a gateway, per link and per job: what a `stats` request returns."""
from __future__ import annotations

import time
from collections import defaultdict


class Meter:
    def __init__(self) -> None:
        self.started = time.time()
        self.links: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})
        self.jobs: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})
        self.refused: dict[str, int] = defaultdict(int)  # error code -> count
        self.dropped: dict[str, int] = defaultdict(int)  # why -> count (full queues; the sender resends)

    def count(self, link: str, job: str, nbytes: int) -> None:
        for counter in (self.links[link], self.jobs[job or "-"]):
            counter["messages"] += 1
            counter["bytes"] += nbytes

    def snapshot(self) -> dict:
        return {"uptime_s": round(time.time() - self.started, 3), "links": dict(self.links),
                "jobs": dict(self.jobs), "refused": dict(self.refused), "dropped": dict(self.dropped)}

    def summary(self) -> str:
        links = ", ".join(f"{name} {c['messages']} msgs/{c['bytes'] / 1e6:.1f} MB" for name, c in sorted(self.links.items()))
        refused = sum(self.refused.values())
        return f"links: {links or 'none'}; refused {refused}; dropped {sum(self.dropped.values())}"
