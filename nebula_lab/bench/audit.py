"""`nebula bench audit`: what one audit record costs the gateway that appends it, against the bare write.

Rows, each the best of `--batches` batches of `--records` appends of the record a gateway writes per
TENSORS message (nebula.security.audit.AuditLog, one file in a temporary directory):
- write: `os.write` of the same bytes to an O_APPEND descriptor, nothing else (the floor: one write(2));
- audit: `AuditLog.append` with the gateway's default fsync interval (1 s): the lock, flock, the hash
  chain's sha256 over canonical JSON, one write(2);
- audit, fsync each: `fsync_interval = 0`, a record on the disk before append returns (what the interval saves).

The best of several batches, because a shared machine's other work only ever adds time. This was a timed
unit test until it failed under load; a speed goal belongs here, beside its floor, not in the suite.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from nebula.security.audit import AuditLog

FIELDS = {"job": "j1", "src": "a/gateway/0", "dst": "b/gateway/0", "kind": "TENSORS", "bytes": 4_194_304,
          "codec": "int8(block=64)"}
GOAL_US = 100.0  # per record at the default interval: well under a message's own handling at the gateway


def register(sub) -> None:
    parser = sub.add_parser("audit", help="cost of one audit record (append) against a bare write(2)")
    parser.add_argument("--records", type=int, default=1000, help="appends per batch (default 1000)")
    parser.add_argument("--batches", type=int, default=5, help="batches; the best counts (default 5)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.records < 1 or args.batches < 1:
        raise SystemExit(f"--records {args.records} --batches {args.batches}: 1 or more each")
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(Path(tmp), args.records, args.batches)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'path':<20}{'us/record':>11}{'x write':>9}")
    for row in rows:
        print(f"{row['path']:<20}{row['us_per_record']:>11.1f}{row['x_write']:>9.1f}")
    audit = next(r for r in rows if r["path"] == "audit")
    verdict = "meets" if audit["us_per_record"] < GOAL_US else "MISSES"
    print(f"audit at the default fsync interval {verdict} the goal of < {GOAL_US:.0f} us per record")
    return 0


def measure(tmp: Path, records: int, batches: int) -> list[dict]:
    line = (json.dumps({"seq": 0, "ts": time.time(), "event": "message", **FIELDS, "prev": "0" * 64,
                        "hash": "0" * 64}) + "\n").encode()
    fd = os.open(tmp / "bare.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        bare = best(lambda: os.write(fd, line), records, batches)
    finally:
        os.close(fd)
    rows = [{"path": "write", "us_per_record": bare * 1e6}]
    for path, interval in (("audit", 1.0), ("audit, fsync each", 0.0)):
        log = AuditLog(tmp / f"{interval}.jsonl", fsync_interval=interval)
        try:
            seconds = best(lambda log=log: log.append("message", **FIELDS), records, batches)
            rows.append({"path": path, "us_per_record": 1e6 * seconds})
        finally:
            log.close()
    return [{**row, "x_write": row["us_per_record"] / rows[0]["us_per_record"], "records": records,
             "batches": batches} for row in rows]


def best(append, records: int, batches: int) -> float:
    """Seconds per call, the best of `batches` batches of `records` calls."""
    times = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(records):
            append()
        times.append((time.perf_counter() - started) / records)
    return min(times)
