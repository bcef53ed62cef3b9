"""A stage's numbers for its status file and metrics: its last step record (nebula.runtime.metrics),
what its links encoded (link.jsonl, which the runner writes beside metrics.jsonl) and what crossed its
channel. Rank 0 of a stage observes; the other ranks only talk to rank 0. The stage's entry point
(`nebula stage run`) hands the runtime `StageWatch.start` to attach to the stage's metrics log.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from nebula.observe.observer import Observer, Observing
from nebula.transport.base import Channel
from nebula.transport.goodput import Goodput
from nebula.wire import Message

STEP_KEYS = ("step", "loss", "step_s", "compute_s", "wire_s")


class LinkTail:
    """Sums of link.jsonl lines (one per encoded tensor) written since this process started reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0  # this process's bytes only
        self.totals: dict[str, Counter] = defaultdict(Counter)  # "link:dir" -> raw, wire
        self.latest: dict[str, tuple[int, dict[str, Counter]]] = {}  # "link:dir" -> (step, codec -> raw, wire)
        self.caches: dict[str, dict[str, dict]] = defaultdict(dict)  # "link:dir" -> tensor -> delta's cache stats

    def read(self) -> dict[str, dict[str, Any]]:
        """Per "link:direction": raw and wire bytes so far (an evaluation's too: they crossed the link);
        the codec that carried most of the latest training step's bytes (a link's ids or masks may go
        uncompressed beside it) and that step's raw / wire; for `delta` tensors, their caches now
        (`delta_cache`: entries, bytes in memory and on disk, hits and misses, summed over tensors; the
        sender's, which the receiver's equals)."""
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written now waits for the next read
            self.offset += len(complete)
            for line in complete.splitlines():
                self._add(json.loads(line))
        return {key: {"raw_bytes": total["raw"], "wire_bytes": total["wire"], **self._now(key), **self._cache(key)}
                for key, total in self.totals.items()}

    def _add(self, entry: dict[str, Any]) -> None:
        if "raw" not in entry:
            return  # an `auto` switch (kind "auto"), not a tensor
        key, step = f"{entry['link']}:{entry['dir']}", entry["step"]
        sizes = Counter(raw=entry["raw"], wire=entry["wire"])
        self.totals[key].update(sizes)
        if isinstance(entry.get("cache"), dict):
            self.caches[key][entry.get("name", "")] = entry["cache"]
        if "split" in entry:
            return  # an evaluation's tensors carry the last step's number but are no part of it
        latest_step, codecs = self.latest.get(key, (step, {}))
        if step > latest_step:
            latest_step, codecs = step, {}
        if step == latest_step:
            codecs.setdefault(entry["codec"], Counter()).update(sizes)
        self.latest[key] = (latest_step, codecs)

    def _cache(self, key: str) -> dict[str, Any]:
        if not self.caches.get(key):
            return {}
        fields = ("entries", "ram_bytes", "disk_bytes", "hits", "misses")
        return {"delta_cache": {f: sum(int(c.get(f, 0)) for c in self.caches[key].values()) for f in fields}}

    def _now(self, key: str) -> dict[str, Any]:
        # A link that has carried only an evaluation's tensors (a stage started after its last step) has
        # no training step yet to name a codec for.
        codecs = self.latest.get(key, (0, {}))[1]
        if not codecs:
            return {}
        raw, wire = sum(c["raw"] for c in codecs.values()), sum(c["wire"] for c in codecs.values())
        return {"codec": max(codecs, key=lambda c: codecs[c]["wire"]), "ratio": round(raw / wire, 3) if wire else 0.0}


class StageNumbers:
    """The numbers of one stage, updated by its step records and its channel, read by its observer."""

    def __init__(self, workdir: Path) -> None:
        self.last: dict[str, Any] = {}
        self.links = LinkTail(Path(workdir) / "link.jsonl")
        self.channel: MeteredChannel | None = None

    def on_record(self, record: dict[str, Any]) -> None:
        """A MetricsLog listener: keeps the last step record's numbers (a dict swap: no lock needed)."""
        if record.get("kind") == "step":
            self.last = {key: record[key] for key in STEP_KEYS if key in record}

    def __call__(self) -> dict[str, Any]:
        numbers = {**self.last, "links": self.links.read()}
        if self.channel is not None:
            numbers.update(self.channel.counts())
        return numbers


class MeteredChannel(Channel):
    """The stage's channel, counting messages and bytes (tensor payloads and bodies) both ways."""

    def __init__(self, inner: Channel) -> None:
        self.inner, self.address = inner, inner.address
        self._lock = threading.Lock()  # the sender thread sends while the runner receives
        self._counts = dict.fromkeys(("messages_in", "bytes_in", "messages_out", "bytes_out"), 0)
        # per sender: when it was last heard from and the step its message was for; what `job list` at
        # this site says of the stages at other sites, which it cannot see otherwise
        self._heard: dict[str, dict[str, float | int]] = {}

    def send(self, msg: Message, timeout: float | None = None) -> None:
        self.inner.send(msg, timeout)
        self._count("out", msg)

    def recv(self, timeout: float | None = None) -> Message:
        msg = self.inner.recv(timeout)
        self._count("in", msg)
        return msg

    def close(self) -> None:
        self.inner.close()

    def outages(self) -> dict[str, float]:
        return self.inner.outages()

    def goodput(self, dst: str, message_bytes: int = 0) -> Goodput | None:
        # what `compression = "auto"` goes by: without it, a stage with a status file never adapted
        return self.inner.goodput(dst, message_bytes)

    def _count(self, direction: str, msg: Message) -> None:
        with self._lock:
            self._counts[f"messages_{direction}"] += 1
            self._counts[f"bytes_{direction}"] += msg.payload_bytes + len(msg.body)
            if direction == "in":
                self._heard[msg.src] = {"t": round(time.time(), 3), "step": msg.step}

    def counts(self) -> dict[str, Any]:
        with self._lock:
            counts: dict[str, Any] = {**self._counts, "peers": {k: dict(v) for k, v in self._heard.items()}}
        stats = getattr(self.inner, "stats", {})  # a ReliableChannel's resends and window
        return {**counts, **{key: stats[key] for key in ("resent", "in_flight", "handshakes") if key in stats}}


class StageWatch:
    """Rank 0 of a stage as its status file and metrics show it (a nebula.runtime.metrics.Watch): its
    step records, its links and its channel, and how its run ended."""

    def __init__(self, observer: Observer, numbers: StageNumbers) -> None:
        self.observer, self.numbers = observer, numbers

    @classmethod
    def start(cls, observing: Observing, label: str, address: str, workdir: Path) -> StageWatch:
        """The stage's observer, as `observing` (its entry point's environment) asks, started: "starting"."""
        numbers = StageNumbers(workdir)
        return cls(observing.observer("stage", address, numbers, service=label).start(background=True), numbers)

    def on_record(self, record: dict[str, Any]) -> None:
        self.numbers.on_record(record)

    @contextmanager
    def watching(self, channel: Channel) -> Iterator[Channel]:
        """Run the stage over a metered `channel`; its status says running, then how it ended."""
        self.numbers.channel = metered = MeteredChannel(channel)
        self.observer.set_state("running")
        try:
            yield metered
        except (KeyboardInterrupt, SystemExit):
            self.observer.close("stopped", "interrupted")
            raise
        except BaseException as exc:
            self.observer.close("failed", f"{type(exc).__name__}: {exc}")
            raise
        self.observer.close("done")
