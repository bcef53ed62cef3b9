"""Byte and message counters of a gateway, per link and per job: what a `stats` request returns."""
from __future__ import annotations

import time
from collections import defaultdict

PEER_COUNTERS = ("messages_in", "bytes_in", "messages_out", "bytes_out", "resend_requests")
MAX_JOBS = 256  # jobs counted apart; a job id is the sender's choice, so later ones share OTHER_JOBS
OTHER_JOBS = "(other)"


class Meter:
    def __init__(self) -> None:
        self.started = time.time()
        self.links: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})
        self.jobs: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})
        self.refused: dict[str, int] = defaultdict(int)  # error code -> count
        self.dropped: dict[str, int] = defaultdict(int)  # why -> count (full queues; the sender resends)
        # peer (another site, or an address of this site's stages) -> counters both ways
        self.peers: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(PEER_COUNTERS, 0))
        self.queues: dict[str, int] = {}  # socket -> messages found waiting at the gateway's last turn on it
        self.rate_limited: dict[str, int] = defaultdict(int)  # sender -> messages dropped over its rate limit
        self.handshakes: dict[str, int] = {"admitted": 0, "refused": 0}  # the ZAP handler's decisions
        # CURVE sessions per link: "in", admitted per certified address (stages, peer gateways dialling in);
        # "out", completed by this gateway's links per peer site (each rekey is one more)
        self.sessions: dict[str, dict[str, int]] = {"in": {}, "out": {}}
        self.queued_bytes: dict[str, int] = {}  # next hop -> bytes handed to ZeroMQ and not yet written out

    def count(self, link: str, job: str, nbytes: int) -> None:
        job = job or "-"
        if job not in self.jobs and len(self.jobs) >= MAX_JOBS:
            job = OTHER_JOBS
        for counter in (self.links[link], self.jobs[job]):
            counter["messages"] += 1
            counter["bytes"] += nbytes

    def passed(self, peer: str, direction: str, nbytes: int, resend: bool = False) -> None:
        """A message received from (`in`) or handed to (`out`) `peer`; `resend`: it asks for a go-back."""
        counter = self.peers[peer]
        counter[f"messages_{direction}"] += 1
        counter[f"bytes_{direction}"] += nbytes
        counter["resend_requests"] += resend

    def status(self) -> dict:
        """The numbers of the gateway's status file and metrics (nebula.observe)."""
        peers = {name: dict(c) for name, c in self.peers.items()}
        totals = {f"{what}_{d}": sum(c[f"{what}_{d}"] for c in peers.values())
                  for what in ("messages", "bytes") for d in ("in", "out")}
        return {**totals, "peers": peers, "refusals": dict(self.refused), "dropped": dict(self.dropped),
                "queues": dict(self.queues), "rate_limited": dict(self.rate_limited),
                "handshakes": dict(self.handshakes), "queued_bytes": dict(self.queued_bytes),
                "sessions": {way: dict(n) for way, n in self.sessions.items()}}

    def snapshot(self) -> dict:
        return {"uptime_s": round(time.time() - self.started, 3), "links": dict(self.links),
                "jobs": dict(self.jobs), "refused": dict(self.refused), "dropped": dict(self.dropped),
                "rate_limited": dict(self.rate_limited), "handshakes": dict(self.handshakes),
                "sessions": {way: dict(n) for way, n in self.sessions.items()}}

    def summary(self) -> str:
        links = ", ".join(f"{name} {c['messages']} msgs/{c['bytes'] / 1e6:.1f} MB"
                          for name, c in sorted(self.links.items()))
        refused = sum(self.refused.values())
        return f"links: {links or 'none'}; refused {refused}; dropped {sum(self.dropped.values())}"
