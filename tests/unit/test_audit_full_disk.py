"""An audit log whose disk is full: no half record is ever left, and a log held down (the gateway's)
counts what it could not write and says so once it can write again. Real kernel errors: /dev/full
answers every write with ENOSPC, and RLIMIT_FSIZE cuts a write short at the limit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from nebula.security.audit import AuditLog, verify
from nebula.security.audit_series import archive_path, series_files

FULL = "/dev/full"
pytestmark = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full (Linux)")


def records(base) -> list[dict]:
    return [json.loads(line) for f in series_files(base) for line in f.read_text().splitlines()]


def fill_up(path) -> None:
    """The live file moves to the archive (an operator's rotation) and the path now names a full disk."""
    os.rename(path, archive_path(path, 1))
    os.symlink(FULL, path)


def test_a_held_log_counts_what_it_could_not_write_and_resumes_the_chain(tmp_path):
    path = tmp_path / "gateway.jsonl"
    log = AuditLog(path, hold_on_failure=True, summary_interval=3600)
    log.append("gateway.started", address="a/gateway/0")
    fill_up(path)
    assert log.append("transfer.in", msg_seq=1) is None
    assert log.down is not None and "No space left on device" in log.down
    assert log.append("transfer.in", msg_seq=2) is None  # down: not even tried
    assert not log.repeated("gateway.refused", {"code": "x"}, {"reason": "r"}, reason="r")
    assert not log.retry()  # the disk is still full
    os.unlink(path)  # space again
    assert log.retry() and log.down is None
    log.append("transfer.in", msg_seq=3)
    log.close()

    assert verify(path).ok, str(verify(path))
    events = [(r["event"], r.get("msg_seq")) for r in records(path)]
    assert events == [("gateway.started", None), ("audit.resumed", None), ("transfer.in", 3)]
    resumed = records(path)[1]
    assert resumed["lost"] == {"transfer.in": 2, "gateway.refused": 1}
    assert "No space left on device" in resumed["reason"] and resumed["down_s"] >= 0


def test_a_log_not_held_raises_and_writes_nothing(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append("first")
    fill_up(path)
    with pytest.raises(OSError):
        log.append("second")
    assert log.down is None  # not held: its caller decides


def test_a_write_cut_short_leaves_no_half_record(tmp_path):
    """RLIMIT_FSIZE makes write(2) stop at the limit: the record that crossed it is cut back out. (Two
    limits: a record that ends exactly at one fails whole, with EFBIG, instead of short.)"""
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    script = textwrap.dedent(f"""
        import resource
        from nebula.security.audit import AuditLog
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        for limit, path in zip((2000, 2077), {[str(p) for p in paths]!r}):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            log = AuditLog(path, hold_on_failure=True)
            n = 0
            while log.down is None:
                log.append("transfer.in", msg_seq=n, pad="x" * 100)
                n += 1
            print(log.down)
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert log.retry()
            log.append("after")
            log.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "short write" in done.stdout, done.stdout
    for path in paths:
        assert verify(path).ok, str(verify(path))
        events = [r["event"] for r in records(path)]
        assert events[-2:] == ["audit.resumed", "after"] and records(path)[-2]["lost"] == {"transfer.in": 1}
