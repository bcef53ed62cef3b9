"""Audit log: hash chain verification finds edits, removals, insertions, reorders; appends are safe and cheap."""
from __future__ import annotations

import json
import multiprocessing
import threading

import pytest

from nebula.errors import ConfigError, DataError
from nebula.security.audit import AuditLog, record_hash, verify


def write_log(path, n=6) -> tuple[int, str]:
    """n message records; returns the log's head (seq, hash)."""
    with AuditLog(path) as log:
        for i in range(n):
            log.append("message", job="j1", src="a/gateway/0", dst="b/gateway/0", kind="TENSORS",
                       bytes=1000 + i, codec="fp16(svd(0.6))")
        return log.head()


def lines(path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def rewrite(path, new_lines) -> None:
    path.write_text("".join(new_lines))


def test_clean_log_verifies_and_head_matches(tmp_path):
    path = tmp_path / "audit.jsonl"
    head = write_log(path)
    result = verify(path)
    assert result.ok and result.records == 6 and str(result).startswith("ok: 6 records")
    assert result.head == head and head[0] == 6
    first = json.loads(lines(path)[0])
    assert first["seq"] == 1 and first["prev"] == "0" * 64 and first["hash"] == record_hash(first)


def test_edited_record_is_found_by_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path)
    content = lines(path)
    content[2] = content[2].replace('"bytes":1002', '"bytes":9')
    rewrite(path, content)
    result = verify(path)
    assert (result.ok, result.line, result.seq, result.records) == (False, 3, 3, 2)
    assert "hash mismatch" in result.problem and str(result).startswith(f"{path} line 3 (seq 3): ")


def test_edited_and_rehashed_record_breaks_the_next_link(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path)
    content = lines(path)
    record = json.loads(content[2])
    record["bytes"] = 9
    record["hash"] = record_hash(record)
    content[2] = json.dumps(record) + "\n"
    rewrite(path, content)
    result = verify(path)
    assert (result.ok, result.line) == (False, 4) and result.problem.startswith("prev does not match")


@pytest.mark.parametrize("tamper, bad_line", [
    (lambda c: c[:2] + c[3:], 3),                     # removed the third record
    (lambda c: c[:2] + [c[3], c[2]] + c[4:], 3),      # swapped records 3 and 4
    (lambda c: c[:3] + [c[1]] + c[3:], 4),            # duplicated an earlier record
])
def test_removed_reordered_or_duplicated_records_are_found(tmp_path, tamper, bad_line):
    path = tmp_path / "audit.jsonl"
    write_log(path)
    rewrite(path, tamper(lines(path)))
    result = verify(path)
    assert (result.ok, result.line) == (False, bad_line) and "seq" in result.problem


def test_inserted_forged_record_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path)
    content = lines(path)
    prev = json.loads(content[1])
    forged = {"seq": 3, "ts": prev["ts"], "event": "peer.admitted", "address": "x/gateway/0", "prev": prev["hash"]}
    forged["hash"] = record_hash(forged)  # a perfectly self-consistent record...
    rewrite(path, content[:2] + [json.dumps(forged) + "\n"] + content[2:])
    result = verify(path)
    assert (result.ok, result.line) == (False, 4)  # ...but the record after it no longer links


def test_truncated_tail_needs_an_anchor(tmp_path):
    path = tmp_path / "audit.jsonl"
    anchor = write_log(path)
    rewrite(path, lines(path)[:-2])
    assert verify(path).ok  # a shorter chain is still a valid chain: the documented limitation
    result = verify(path, anchor=anchor)
    assert not result.ok and "removed from the end" in result.problem
    assert not verify(path, anchor=(2, "f" * 64)).ok


def test_torn_last_write_is_reported_and_blocks_appends(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path)
    content = lines(path)
    rewrite(path, content[:-1] + [content[-1][:40]])
    result = verify(path)
    assert (result.ok, result.line) == (False, 6) and "cut short" in result.problem
    with AuditLog(path) as log, pytest.raises(DataError, match="partial or malformed"):
        log.append("config.changed", key="x")


def test_payload_bytes_and_reserved_fields_are_refused(tmp_path):
    with AuditLog(tmp_path / "audit.jsonl") as log:
        with pytest.raises(ConfigError, match="never payload bytes"):
            log.append("message", payload=b"\x00\x01")
        with pytest.raises(ConfigError, match="reserved"):
            log.append("message", seq=5)
        log.append("config.changed", key="codec", value="int8")
    assert verify(tmp_path / "audit.jsonl").records == 1  # refused appends left nothing behind


def _append_many(path: str, n: int) -> None:
    with AuditLog(path) as log:
        for i in range(n):
            log.append("message", worker="proc", i=i)


def test_threads_and_processes_append_to_one_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append("config.changed", key="start")  # the forked children inherit this open descriptor
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), 150)) for _ in range(2)]
    forked_same_object = ctx.Process(target=lambda: [log.append("message", worker="fork") for _ in range(50)])
    threads = [threading.Thread(target=lambda: [log.append("message", worker="thread") for _ in range(150)])
               for _ in range(3)]
    for worker in (*procs, forked_same_object, *threads):
        worker.start()
    for worker in (*procs, forked_same_object, *threads):
        worker.join(timeout=60)
    assert all(p.exitcode == 0 for p in (*procs, forked_same_object))
    log.close()
    result = verify(path)
    assert result.ok, str(result)
    assert result.records == 1 + 2 * 150 + 50 + 3 * 150


def test_the_append_cost_benchmark_times_real_appends_that_leave_a_valid_chain(tmp_path):
    """What an append costs is `nebula bench audit`'s (a speed goal is no test: under load it fails); here,
    that what it times is the real thing: every append it made is in a chain that verifies."""
    from nebula_lab.bench.audit import measure
    rows = measure(tmp_path, records=50, batches=2)
    assert [r["path"] for r in rows] == ["write", "audit", "audit, fsync each"]
    assert all(r["us_per_record"] > 0 for r in rows) and rows[0]["x_write"] == 1.0
    for name in ("1.0.jsonl", "0.0.jsonl"):
        result = verify(tmp_path / name)
        assert result.ok and result.records == 100
