"""Tamper-evident audit log: append-only JSON lines, each record hash-chained to the one before.

Record: {"seq", "ts", "event", ...fields, "prev": hash of the previous record, "hash"}, where
hash = sha256(canonical JSON of the record without "hash"). Editing a record breaks its hash;
removing, inserting or reordering breaks the next record's seq or prev. Removing records from the
*end* leaves a valid shorter chain: only an anchor kept elsewhere (`head()`, `verify(anchor=...)`)
detects that (see docs/security.md).

Appends are safe across threads (a lock) and processes (flock on the file, then re-reading the
tail if another process wrote since). Each record is one write(2) to an O_APPEND descriptor, so it
reaches the kernel at once (survives a crash of this process); fsync(2) is batched: at most one
per `fsync_interval` seconds (0: every record, None: only on close).

At production rates, and under a flood, three things keep the log useful and its growth bounded:
`tally()` counts frequent routine messages (acks, heartbeats) into one summary record per key per
`summary_interval` instead of one record each; `repeated()` writes a security event that a peer can
repeat at will (a refusal, a handshake) in full only the first `full_records` times per key and
interval, and counts the rest into one summary record, so every decision stays accounted for; and
the file is rotated past `max_bytes`, the chain continuing in the next file
(nebula.security.audit_series names them). The keys counted per interval are bounded (`MAX_KEYS`):
beyond, events share one key whose values are all `OTHER`.

A write that fails (a full disk, an I/O error) never leaves half a record: the file is cut back to
its last whole one. By default the error is raised. With `hold_on_failure` (the gateway's log) the
log goes *down* instead: it writes nothing and counts per event what it could not write, until
`retry()` succeeds in writing an `audit.resumed` record that says for how long and what was lost.
Its owner reads `down` and fails closed meanwhile (the gateway forwards nothing it cannot record).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from nebula.errors import ConfigError, DataError
from nebula.security.audit_series import archive_path, archives, last_record, series_base
from nebula.security.canonical import canonical_json

GENESIS = "0" * 64
RESERVED = frozenset({"seq", "ts", "event", "prev", "hash"})
SUMMARY_FIELDS = frozenset({"messages", "bytes", "first_ts", "last_ts"})
REPEAT_FIELDS = frozenset({"recorded", "suppressed", "reasons", "distinct", "first_ts", "last_ts"})
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_SUMMARY_INTERVAL = 10.0
DEFAULT_FULL_RECORDS = 5
# Bounds on what one interval's counts hold (in memory, and in summary records at its end); the key
# values of a flood (an address, a job id) may be an attacker's choice.
MAX_KEYS = 1024  # keys per kind of count (tallies, repeats); later keys share the key of OTHER values
MAX_REASONS = 8  # distinct reasons named in one summary; the rest are counted under OTHER
MAX_DISTINCT = 256  # distinct values (e.g. keys of refused handshakes) counted per summary, at most
OTHER = "(other)"


def record_hash(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


@dataclass
class _Repeats:
    """One key's counts of a `repeated()` event within an interval."""

    recorded: int = 0
    suppressed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    distinct: set[str] = field(default_factory=set)
    first_ts: float = 0.0
    last_ts: float = 0.0

    def count(self, reason: str, distinct: str | None, now: float) -> None:
        self.suppressed += 1
        self.first_ts, self.last_ts = self.first_ts or now, now
        if reason not in self.reasons and len(self.reasons) >= MAX_REASONS:
            reason = OTHER
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if distinct is not None and len(self.distinct) < MAX_DISTINCT:
            self.distinct.add(distinct)

    def summary(self) -> dict:
        return {"recorded": self.recorded, "suppressed": self.suppressed, "reasons": self.reasons,
                "distinct": len(self.distinct), "first_ts": self.first_ts, "last_ts": self.last_ts}


class AuditLog:
    """`path` is the live file; `max_bytes` its size limit before rotation (a single larger record
    still goes in, alone); `summary_interval` the seconds one summary record of `tally()` or
    `repeated()` covers; `full_records` how many of one key's `repeated()` events per interval are
    written in full; `clock` the unix time a record's `ts` (and a summary's times) is read from (a
    fixed one makes a log's bytes reproducible: the examples of docs/protocol.md)."""

    def __init__(self, path: str | os.PathLike, fsync_interval: float | None = 1.0,
                 max_bytes: int = DEFAULT_MAX_BYTES, summary_interval: float = DEFAULT_SUMMARY_INTERVAL,
                 full_records: int = DEFAULT_FULL_RECORDS, clock: Callable[[], float] = time.time,
                 hold_on_failure: bool = False):
        self.path = Path(path)
        self.clock = clock
        self.fsync_interval = fsync_interval
        self.max_bytes = _positive(max_bytes, "max_bytes", int)
        self.summary_interval = _positive(summary_interval, "summary_interval", (int, float))
        self.full_records = _positive(full_records, "full_records", int)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self._end = -1  # live file's size right after the last record this process knows of
        self._seq, self._hash = 0, GENESIS
        self._last_fsync = time.monotonic()
        self._tallies: dict[tuple, list] = {}  # (event, key items) -> [messages, bytes, first_ts, last_ts]
        self._repeats: dict[tuple, _Repeats] = {}  # (event, key items) -> this interval's counts
        self._tally_pid, self._tally_since = os.getpid(), 0.0
        self.hold_on_failure = hold_on_failure
        self.down: str | None = None  # why the last write failed, while the log is down (hold_on_failure)
        self._down_since = 0.0
        self._lost: dict[str, int] = {}  # event -> records not written while down

    def append(self, event: str, **fields: Any) -> dict | None:
        """Append one record and return it (None if the log is down). Values must be JSON: log sizes and
        hashes, never payloads."""
        _check(event, fields, RESERVED)
        with self._lock:
            written = self._write([(event, fields)])
        return written[0] if written else None

    def retry(self) -> bool:
        """While down: try to write `audit.resumed` {down_s, reason, lost: {event: records}}; -> up now."""
        with self._lock:
            if self.down is None:
                return True
            resumed = {"down_s": round(time.monotonic() - self._down_since, 3), "reason": self.down,
                       "lost": dict(self._lost)}
            try:
                self._write_records([("audit.resumed", resumed)], [])
            except OSError:
                return False  # still down, for the first cause
            self.down, self._lost = None, {}
            return True

    def tally(self, event: str, nbytes: int, **key: Any) -> None:
        """Count one message of `nbytes` under (event, key); `flush_summaries` writes one record per key:
        {event, **key, messages, bytes, first_ts, last_ts}. For routine traffic, never security events."""
        now = self.clock()
        with self._lock:
            slot = self._slot(self._tallies, event, key, RESERVED | SUMMARY_FIELDS)
            counts = self._tallies.get(slot)
            if counts is None:
                self._tallies[slot] = [1, nbytes, now, now]
            else:
                counts[0] += 1
                counts[1] += nbytes
                counts[3] = now
            due = time.monotonic() - self._tally_since >= self.summary_interval
        if due:
            self.flush_summaries(due_only=True)

    def repeated(self, event: str, key: dict[str, Any], fields: dict[str, Any], reason: str,
                 distinct: str | None = None) -> bool:
        """A security event that a peer can repeat at will (a refusal, a handshake). The first
        `full_records` per (event, key) and interval are appended in full, {**key, **fields}; the others
        are counted into one `<event>.summary` record per key, written when the interval ends:
        {**key, recorded (in full), suppressed (counted only), reasons: {reason: count} (MAX_REASONS,
        then OTHER), distinct (values of `distinct` seen, up to MAX_DISTINCT), first_ts, last_ts} of the
        suppressed ones. `reason` should name a kind of decision, not repeat the key. -> written in full."""
        now = self.clock()
        with self._lock:
            slot = self._slot(self._repeats, event, key, RESERVED | REPEAT_FIELDS)
            counts = self._repeats.setdefault(slot, _Repeats())
            full = counts.recorded < self.full_records
            if full:
                _check(event, fields, RESERVED)
                full = bool(self._write([(event, {**key, **fields})]))
                counts.recorded += 1
            else:
                counts.count(reason, distinct, now)
            due = time.monotonic() - self._tally_since >= self.summary_interval
        if due:
            self.flush_summaries(due_only=True)
        return full

    def _slot(self, counts: dict, event: str, key: dict[str, Any], reserved: frozenset) -> tuple:
        """Under the lock: the slot of (event, key) in `counts`, or, once MAX_KEYS are in use, the one
        slot of OTHER values that later keys share. Starts the interval at its first count."""
        if self._tally_pid != os.getpid():  # a forked child: the parent's counts are the parent's
            self._tallies, self._repeats, self._tally_pid = {}, {}, os.getpid()
        slot = (event, tuple(key.items()))
        if slot not in counts:
            _check(event, key, reserved)
            if len(counts) >= MAX_KEYS:
                slot = (event, tuple((name, OTHER) for name in key))
            if not self._tallies and not self._repeats:
                self._tally_since = time.monotonic()
        return slot

    def flush_summaries(self, due_only: bool = False) -> int:
        """Write the pending summary records (with `due_only`, only once the oldest count is
        `summary_interval` old: call it from a loop); returns how many were written."""
        with self._lock:
            if not (self._tallies or self._repeats) or self._tally_pid != os.getpid():
                return 0
            if due_only and time.monotonic() - self._tally_since < self.summary_interval:
                return 0
            (tallies, self._tallies), (repeats, self._repeats) = (self._tallies, {}), (self._repeats, {})
            entries = [(event, {**dict(key), "messages": n, "bytes": b, "first_ts": first, "last_ts": last})
                       for (event, key), (n, b, first, last) in tallies.items()]
            entries += [(f"{event}.summary", {**dict(key), **counts.summary()})
                        for (event, key), counts in repeats.items() if counts.suppressed]
            return len(self._write(entries)) if entries else 0

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last record: keep it elsewhere to detect later removal of the tail."""
        with self._lock:
            fd = self._locked_descriptor()
            try:
                self._catch_up(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return self._seq, self._hash

    def close(self) -> None:
        self.flush_summaries()
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                try:
                    os.fsync(self._fd)
                except OSError:
                    if not self.hold_on_failure:  # held: what could not be written is counted already
                        raise
                finally:
                    os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- under self._lock ----------------------------------------------------------------
    def _write(self, entries: list[tuple[str, dict]]) -> list[dict]:
        """The records written, in order; all of them, unless the log is held down (then the rest are
        counted as lost)."""
        written: list[dict] = []
        if self.down is None:
            try:
                self._write_records(entries, written)
            except OSError as exc:
                if not self.hold_on_failure:
                    raise
                self.down, self._down_since = _failure(self.path, exc), time.monotonic()
        for event, _ in entries[len(written):]:
            self._lost[event] = self._lost.get(event, 0) + 1
        return written

    def _write_records(self, entries: list[tuple[str, dict]], written: list[dict]) -> None:
        fd = self._locked_descriptor()
        try:
            self._catch_up(fd)
            for event, fields in entries:
                record, line = self._next(event, fields)
                while 0 < self._end and self._end + len(line) > self.max_bytes:  # another may fill the new one first
                    fd = self._rotate(fd)
                    self._catch_up(fd)  # normally the archive's last record; another process may have written
                    record, line = self._next(event, fields)
                _write_whole(fd, line, self._end)
                self._end += len(line)
                self._seq, self._hash = record["seq"], record["hash"]
                written.append(record)
            self._maybe_fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _next(self, event: str, fields: dict) -> tuple[dict, bytes]:
        record = {"seq": self._seq + 1, "ts": self.clock(), "event": event, **fields, "prev": self._hash}
        body = _encode(record)
        digest = hashlib.sha256(body).hexdigest()
        record["hash"] = digest
        # Same JSON object with "hash" added; verify re-derives the canonical body, not this text.
        return record, body[:-1] + b',"hash":"' + digest.encode() + b'"}\n'

    def _descriptor(self) -> int:
        # After fork the inherited descriptor shares its flock with the parent: open our own.
        if self._fd is None or self._pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            self._pid, self._end = os.getpid(), -1
        return self._fd

    def _locked_descriptor(self) -> int:
        """Our descriptor of the live file, flocked. If another process rotated the file while we
        waited, ours now names an archive: reopen the path and lock the new live file."""
        while True:
            fd = self._descriptor()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(self.path, fd):
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._fd = None

    def _rotate(self, fd: int) -> int:
        """Holding the full live file's lock: rename it to the next archive, lock the new live file.
        Another process may create, fill and even rotate the new file before we lock it (it never waited
        on the old one's lock): `_locked_descriptor` finds the file the path names then."""
        os.fsync(fd)
        numbers = [number for number, _ in archives(self.path)]
        os.rename(self.path, archive_path(self.path, max(numbers, default=0) + 1))
        _fsync_dir(self.path.parent)  # the rename survives a power loss
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        self._fd = None
        return self._locked_descriptor()

    def _catch_up(self, fd: int) -> None:
        """If the live file changed since our last write, take seq/hash from its last record or, when
        it is empty (just rotated, or a restart found only archives), from the newest archive's."""
        size = os.fstat(fd).st_size
        if size == self._end:
            return
        self._end = size
        newest = archives(self.path)[-1:] if size == 0 else []
        record = last_record(self.path, fd) if size else (last_record(newest[0][1]) if newest else None)
        self._seq, self._hash = (int(record["seq"]), str(record["hash"])) if record else (0, GENESIS)

    def _maybe_fsync(self, fd: int) -> None:
        if self.fsync_interval is None:
            return
        now = time.monotonic()
        if now - self._last_fsync >= self.fsync_interval:
            os.fsync(fd)
            self._last_fsync = now


def _write_whole(fd: int, line: bytes, end: int) -> None:
    """One record in one write(2), or none of it: a short write (the disk filled up meanwhile) is cut
    back to `end`, the file's size before it, so that the next record starts on a line of its own."""
    done = os.write(fd, line)  # when it raises, it wrote nothing
    if done < len(line):
        os.ftruncate(fd, end)
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write: {done} of {len(line)} bytes)")


def _failure(path: Path, exc: OSError) -> str:
    return f"cannot write {path}: {exc.strerror or exc}"


def _check(event: str, fields: dict, reserved: frozenset) -> None:
    if not event or not isinstance(event, str):
        raise ConfigError(f"audit event name must be a non-empty string, got {event!r}")
    clash = reserved & fields.keys()
    if clash:
        raise ConfigError(f"audit fields {sorted(clash)} are reserved; rename them")


def _positive(value: Any, name: str, kind: type[int] | tuple[type[int], type[float]]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ConfigError(f"audit log {name} must be a positive number, got {value!r}")
    return value


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_ino, on_disk.st_dev) == (mine.st_ino, mine.st_dev)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(record: dict) -> bytes:
    try:
        return canonical_json(record)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"audit record {record.get('event')!r} has a value that is not JSON ({exc}); "
                          "log sizes, names and hashes, never payload bytes") from exc


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int  # records verified before the first problem (all of them when ok)
    head: tuple[int, str]  # (seq, hash) of the last good record
    line: int | None = None
    seq: int | None = None
    problem: str | None = None
    file: Path | None = None  # the file (or missing file) where the problem is
    files: int = 1  # files of the series checked

    def __str__(self) -> str:
        if self.ok:
            files = f" in {self.files} files" if self.files != 1 else ""
            return f"ok: {self.records} records{files} (head seq {self.head[0]} hash {self.head[1][:16]})"
        where = " ".join(part for part in (
            str(self.file) if self.file else "", f"line {self.line}" if self.line else "",
            f"(seq {self.seq})" if self.seq is not None else "") if part)
        return f"{where}: {self.problem}"


def verify(path: str | os.PathLike, anchor: tuple[int, str] | None = None) -> VerifyResult:
    """Check the whole series `path` belongs to (its live file or one of its archives): every file in
    order, the chain running on across files. `anchor` (seq, hash), recorded earlier, must be in it."""
    base = series_base(Path(path))
    chain = _Chain(anchor)
    try:
        for file, live in _series(base):
            chain.check_file(file, live)
        chain.check_anchor(base)
    except _Broken as broken:
        return VerifyResult(False, chain.count, (chain.seq, chain.prev), broken.line, broken.seq,
                            broken.problem, broken.file, chain.files)
    return VerifyResult(True, chain.count, (chain.seq, chain.prev), files=chain.files)


class _Broken(Exception):
    def __init__(self, problem: str, file: Path, line: int | None = None, seq: int | None = None):
        super().__init__(problem)
        self.problem, self.file, self.line, self.seq = problem, file, line, seq


def _series(base: Path) -> Iterator[tuple[Path, bool]]:
    """(file, is the live file) in chain order; _Broken where an archive number or the live file is missing."""
    numbered = archives(base)
    if not numbered and not base.is_file():
        raise DataError(f"cannot read audit log {base}: no such file, and no archives "
                        f"({archive_path(base, 1).name}, ...) beside it")
    for want, (number, file) in enumerate(numbered, start=1):
        if number != want:
            after = f"after {archive_path(base, want - 1).name}" if want > 1 else "at the start"
            raise _Broken(f"archive missing {after} (the next one is {file.name}): removed or renamed",
                          archive_path(base, want))
        yield file, False
    if not base.is_file():
        raise _Broken(f"the live file is missing after {numbered[-1][1].name}: the newest records were "
                      "removed (a restarted writer recreates it, continuing the chain)", base)
    yield base, True


class _Chain:
    """The last good record of a verification, carried from one file of the series to the next."""

    def __init__(self, anchor: tuple[int, str] | None) -> None:
        self.seq, self.prev, self.count, self.files = 0, GENESIS, 0, 0
        self.anchor, self.anchored = anchor, anchor is None
        self.last_file: Path | None = None

    def check_file(self, file: Path, live: bool) -> None:
        self.files += 1
        line = 0
        for line, raw in _lines(file):
            record, problem = _check_record(raw, self.seq + 1, self.prev)
            if problem:
                raise _Broken(self._explain(problem, raw, line, live), file, line,
                              record.get("seq") if isinstance(record, dict) else None)
            self.seq, self.prev, self.count = record["seq"], record["hash"], self.count + 1
            if self.anchor and self.seq == self.anchor[0]:
                if self.prev != self.anchor[1]:
                    raise _Broken("hash differs from the anchor: rewritten", file, line, self.seq)
                self.anchored = True
        if line == 0 and not live:
            raise _Broken("the archive is empty: it was truncated", file)
        self.last_file = file

    def _explain(self, problem: str, raw: bytes, line: int, live: bool) -> str:
        """Say what a broken link means where one file meets the next, or at an archive's end."""
        if not raw.endswith(b"\n") and not live:
            return "the archive was truncated: its last record is cut short"
        if line == 1 and self.last_file is not None and ("seq" in problem or "prev" in problem):
            reason = problem.split(":")[0]
            name = self.last_file.name
            return (f"{reason}: this file does not continue {name}: {name} was truncated, "
                    "or files of the series were removed, renamed or reordered")
        return problem

    def check_anchor(self, base: Path) -> None:
        if not self.anchored:
            assert self.anchor is not None  # without an anchor, a chain is anchored from the start
            raise _Broken(f"log ends at seq {self.seq} but the anchor names seq {self.anchor[0]}: "
                          "records were removed from the end", base)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with path.open("rb") as f:
            yield from enumerate(f, start=1)
    except OSError as exc:
        raise DataError(f"cannot read audit log {path} ({exc})") from exc


def _check_record(raw: bytes, want_seq: int, want_prev: str) -> tuple[Any, str | None]:
    if not raw.endswith(b"\n"):
        return None, "record not terminated by a newline: the last write was cut short"
    try:
        record = json.loads(raw)
    except ValueError:
        return None, "not a JSON record"
    if not isinstance(record, dict) or not RESERVED <= record.keys():
        return record, f"not an audit record: needs the fields {sorted(RESERVED)}"
    if record["hash"] != record_hash(record):
        return record, "hash mismatch: the record was edited"
    if record["seq"] != want_seq:
        how = "removed or reordered" if record["seq"] > want_seq else "inserted, duplicated or reordered"
        return record, f"expected seq {want_seq}, found {record['seq']}: a record was {how} before this line"
    if record["prev"] != want_prev:
        return record, "prev does not match the previous record's hash: a record was removed, inserted or reordered"
    return record, None
