"""Security events a peer can repeat at will (refusals, handshakes): the first few per source and interval
in full, the rest counted into one summary record, so a flood costs a bounded number of records while
every decision stays accounted for; and the number of keys counted per interval is bounded too."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.security import audit
from nebula.security.audit import AuditLog, verify


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def refuse(log: AuditLog, sender: str, reason: str, n: int, code: str = "wire") -> list[bool]:
    return [log.repeated("gateway.refused", {"sender": sender, "code": code}, {"reason": reason, "dst": "b/x/0"},
                         reason=reason) for _ in range(n)]


def test_the_first_few_go_in_full_the_rest_into_one_summary_per_key_and_interval(tmp_path):
    path = tmp_path / "gateway.jsonl"
    with AuditLog(path, summary_interval=0.3, full_records=3) as log:
        assert refuse(log, "a/flood/0", "malformed envelope", 1000) == [True] * 3 + [False] * 997
        assert refuse(log, "a/other/0", "malformed envelope", 2) == [True, True]  # its own key: in full
        assert refuse(log, "a/flood/0", "malformed envelope", 1, code="spoof") == [True]  # so is another code
        time.sleep(0.35)
        assert refuse(log, "a/flood/0", "too big", 5) == [False, True, True, True, False]
    got = records(path)
    events = [r["event"] for r in got]
    assert events.count("gateway.refused") == 3 + 2 + 1 + 3
    summaries = [r for r in got if r["event"] == "gateway.refused.summary"]
    # The first call of the new interval still counted into the old one, whose summary it then wrote.
    assert [(s["sender"], s["code"], s["recorded"], s["suppressed"]) for s in summaries] \
        == [("a/flood/0", "wire", 3, 998), ("a/flood/0", "wire", 3, 1)]
    assert summaries[0]["reasons"] == {"malformed envelope": 997, "too big": 1}
    assert summaries[0]["first_ts"] <= summaries[0]["last_ts"] <= summaries[0]["ts"]
    assert verify(path).ok


def test_reasons_and_distinct_values_are_bounded(tmp_path):
    path = tmp_path / "zap.jsonl"
    with AuditLog(path, full_records=1) as log:
        for i in range(audit.MAX_DISTINCT + 50):
            log.repeated("auth.refused", {"domain": "internal", "peer": "10.0.0.9"}, {"curve_key": f"k{i}"},
                         reason=f"unknown key k{i}" if i % 2 else "unknown key", distinct=f"k{i}")
    summary = records(path)[-1]
    assert summary["event"] == "auth.refused.summary" and summary["suppressed"] == audit.MAX_DISTINCT + 49
    assert summary["distinct"] == audit.MAX_DISTINCT  # counted up to the cap
    assert len(summary["reasons"]) == audit.MAX_REASONS + 1
    assert sum(summary["reasons"].values()) == summary["suppressed"]
    assert summary["reasons"]["(other)"] > 0


def test_keys_beyond_the_limit_share_one_slot_and_nothing_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(audit, "MAX_KEYS", 4)
    path = tmp_path / "gateway.jsonl"
    with AuditLog(path, full_records=1) as log:
        for i in range(10):
            refuse(log, f"a/s{i}/0", "bad", 3)
            log.tally("transfer.summary", 10, direction="out", job=f"job-{i}", src="a/s/0", dst="b/d/0", kind="ACK")
    got = records(path)
    summaries = [r for r in got if r["event"] == "gateway.refused.summary"]
    assert len(summaries) == 4 + 1
    other = next(s for s in summaries if s["sender"] == audit.OTHER)
    assert other["code"] == audit.OTHER and other["recorded"] == 1 and other["suppressed"] == 6 * 3 - 1
    assert sum(1 for r in got if r["event"] == "gateway.refused") + sum(s["suppressed"] for s in summaries) == 30
    tallies = [r for r in got if r["event"] == "transfer.summary"]
    assert len(tallies) == 5 and sum(t["messages"] for t in tallies) == 10
    assert [t["job"] for t in tallies if t["messages"] > 1] == [audit.OTHER]


def test_repeated_fields_are_checked(tmp_path):
    with AuditLog(tmp_path / "a.jsonl") as log:
        with pytest.raises(ConfigError, match="reserved"):
            log.repeated("gateway.refused", {"suppressed": 1}, {}, reason="x")
        with pytest.raises(ConfigError, match="reserved"):
            log.repeated("gateway.refused", {"sender": "a"}, {"seq": 3}, reason="x")
    with pytest.raises(ConfigError, match="full_records must be a positive number"):
        AuditLog(tmp_path / "a.jsonl", full_records=0)
