"""Audit log at production rates: size rotation with the chain continued across files, verification of
the whole series (edits, removed, renamed or truncated files), restarts, and per-interval summaries."""
from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from nebula.cli import main as nebula
from nebula.errors import ConfigError, DataError
from nebula.security.audit import AuditLog, verify
from nebula.security.audit_series import archive_path, series_files

LIMIT = 2000  # bytes per file: about ten of the records below


def write(path: Path, n: int, max_bytes: int = LIMIT, start: int = 0) -> tuple[int, str]:
    with AuditLog(path, max_bytes=max_bytes) as log:
        for i in range(start, start + n):
            log.append("transfer.out", job="j1", src="a/encoder/0", dst="b/decoder/0", kind="TENSORS",
                       bytes=1000 + i, codecs=["fp16"])
        return log.head()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for file in series_files(path) for line in file.read_text().splitlines()]


def test_rotation_keeps_files_under_the_limit_and_one_chain_across_them(tmp_path):
    path = tmp_path / "audit" / "gateway.jsonl"
    head = write(path, 60)
    files = series_files(path)
    assert files[-1] == path and files[:-1] == [archive_path(path, n) for n in range(1, len(files))]
    assert files[0].name == "gateway.000001.jsonl" and len(files) >= 5
    assert all(0 < f.stat().st_size <= LIMIT for f in files)
    for older, newer in zip(files, files[1:]):  # each file's first record chains to the previous file's last
        last, first = json.loads(older.read_text().splitlines()[-1]), json.loads(newer.read_text().splitlines()[0])
        assert (first["seq"], first["prev"]) == (last["seq"] + 1, last["hash"])
    assert [r["bytes"] for r in records(path)] == [1000 + i for i in range(60)]  # nothing lost, in order
    result = verify(path)
    assert result.ok and result.records == 60 and result.files == len(files) and result.head == head
    assert str(result).startswith(f"ok: 60 records in {len(files)} files")
    assert verify(files[1]).records == 60  # an archive's name stands for its whole series


def test_a_record_larger_than_the_limit_gets_a_file_of_its_own(tmp_path):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path, max_bytes=300) as log:
        log.append("key.issued", address="a/x/0")
        log.append("config.changed", key="note", new="x" * 500)
        log.append("key.revoked", serial=3)
    assert [len(f.read_text().splitlines()) for f in series_files(path)] == [1, 1, 1]
    assert verify(path).ok


@pytest.mark.parametrize("leave", ["live file", "no live file", "empty live file"])
def test_a_restarted_writer_continues_the_chain_of_the_newest_file(tmp_path, leave):
    path = tmp_path / "gateway.jsonl"
    seq, _ = write(path, 25)
    if leave != "live file":  # as if it died right after a rotation renamed the live file away
        path.rename(archive_path(path, len(series_files(path))))
        if leave == "empty live file":
            path.touch()
    write(path, 10, start=25)
    result = verify(path)
    assert result.ok and result.records == seq + 10, str(result)
    assert [r["bytes"] for r in records(path)] == [1000 + i for i in range(35)]


def _append_many(path: str, tag: str, n: int) -> None:
    with AuditLog(path, max_bytes=LIMIT) as log:
        for i in range(n):
            log.append("transfer.out", worker=tag, i=i)


def test_processes_rotating_one_log_keep_one_chain(tmp_path):
    path = tmp_path / "gateway.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), f"p{k}", 150)) for k in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    result = verify(path)
    assert result.ok and result.records == 450 and result.files > 10, str(result)
    got = [(r["worker"], r["i"]) for r in records(path)]
    assert sorted(got) == sorted((f"p{k}", i) for k in range(3) for i in range(150))  # none lost or doubled
    assert all(f.stat().st_size <= LIMIT for f in series_files(path))


# --- verification of a series -------------------------------------------------------------------
@pytest.fixture
def series(tmp_path) -> list[Path]:
    """A log of 50 records in several files: archives 1.. and the live file."""
    path = tmp_path / "audit" / "gateway.jsonl"
    write(path, 50)
    files = series_files(path)
    assert len(files) >= 5
    return files


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_an_edited_record_in_an_archive_is_named_by_file_and_line(series):
    content = lines(series[1])
    content[2] = content[2].replace('"bytes":10', '"bytes":90')
    series[1].write_text("".join(content))
    result = verify(series[-1])
    assert not result.ok and (result.file, result.line) == (series[1], 3) and "edited" in result.problem
    assert str(result).startswith(f"{series[1]} line 3 (seq ")


def test_a_removed_archive_is_reported_missing(series):
    series[2].unlink()
    result = verify(series[-1])
    assert not result.ok and result.file == series[2] and "archive missing after" in result.problem
    series[0].unlink()
    assert verify(series[-1]).file == series[0]  # even the oldest one: the series must start at 000001


def test_swapped_archives_are_found_where_the_chain_breaks(series):
    first, second = series[1].read_text(), series[2].read_text()
    series[1].write_text(second)
    series[2].write_text(first)
    result = verify(series[-1])
    assert not result.ok and (result.file, result.line) == (series[1], 1)
    assert f"does not continue {series[0].name}" in result.problem


@pytest.mark.parametrize("cut", ["whole records", "mid-record"])
def test_a_truncated_archive_is_found(series, cut):
    content = lines(series[1])
    series[1].write_text("".join(content[:-2]) if cut == "whole records" else "".join(content)[:-30])
    result = verify(series[-1])
    assert not result.ok
    if cut == "whole records":  # the next file no longer follows on
        assert (result.file, result.line) == (series[2], 1) and f"{series[1].name} was truncated" in result.problem
    else:
        assert result.file == series[1] and "archive was truncated" in result.problem


def test_an_emptied_archive_or_a_removed_live_file_is_found(series):
    series[-1].unlink()
    result = verify(series[0])
    assert not result.ok and result.file == series[-1] and "live file is missing" in result.problem
    series[3].write_text("")
    result = verify(series[0])
    assert not result.ok and result.file == series[3] and "empty" in result.problem


def test_an_anchor_holds_across_files(series):
    head = verify(series[-1]).head
    series[-1].write_text("".join(lines(series[-1])[:-1]))
    result = verify(series[-1], anchor=head)
    assert not result.ok and "removed from the end" in result.problem
    assert verify(series[-1], anchor=(3, verify(series[0]).head[1])).problem.startswith("hash differs")


def test_a_missing_log_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file, and no archives"):
        verify(tmp_path / "nothing.jsonl")


def test_cli_verifies_a_directory_of_series_and_fails_on_any(series, capsys):
    other = series[0].parent / "keys.jsonl"
    write(other, 3, max_bytes=1 << 20)
    assert nebula(["audit", "verify", str(series[0].parent)]) == 0
    out = capsys.readouterr().out
    assert f"{series[-1]}: ok: 50 records in {len(series)} files" in out and f"{other}: ok: 3 records" in out
    series[2].unlink()
    assert nebula(["audit", "verify", str(series[0].parent)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {series[-1]}: {series[2]}: archive missing" in out and f"{other}: ok" in out
    assert nebula(["audit", "verify", str(series[0].parent), "--anchor", f"3:{'a' * 64}"]) == 2
    assert "--anchor names one log" in capsys.readouterr().err


def test_cli_show_reads_the_series_in_order(series, capsys):
    assert nebula(["audit", "show", str(series[-1]), "--tail", "15", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["seq"] for r in shown] == list(range(36, 51))  # across the last files


# --- summaries ---------------------------------------------------------------------------------------
def test_tallies_become_one_summary_record_per_key_and_interval(tmp_path):
    path = tmp_path / "gateway.jsonl"
    with AuditLog(path, summary_interval=0.3) as log:
        for _ in range(5):
            log.tally("transfer.summary", 40, direction="in", src="b/decoder/0", dst="a/encoder/0", kind="ACK")
        log.tally("transfer.summary", 90, direction="out", src="a/encoder/0", dst="b/decoder/0", kind="HEARTBEAT")
        log.append("auth.refused", peer="1.2.3.4", reason="unknown key")  # security events are never held back
        assert log.flush_summaries(due_only=True) == 0  # the interval is not over
        time.sleep(0.35)
        log.tally("transfer.summary", 40, direction="in", src="b/decoder/0", dst="a/encoder/0", kind="ACK")
        log.tally("transfer.summary", 40, direction="in", src="b/decoder/0", dst="a/encoder/0", kind="ACK")
    got = records(path)
    assert [r["event"] for r in got] == ["auth.refused", "transfer.summary", "transfer.summary", "transfer.summary"]
    ack, heartbeat = got[1], got[2]
    assert (ack["kind"], ack["messages"], ack["bytes"], ack["direction"]) == ("ACK", 6, 240, "in")
    assert (heartbeat["kind"], heartbeat["messages"], heartbeat["bytes"]) == ("HEARTBEAT", 1, 90)
    assert ack["first_ts"] <= ack["last_ts"] <= ack["ts"]
    assert (got[3]["messages"], got[3]["kind"]) == (1, "ACK")  # the last one, written by close()
    assert verify(path).ok


def test_summary_fields_and_knobs_are_checked(tmp_path):
    with AuditLog(tmp_path / "a.jsonl") as log, pytest.raises(ConfigError, match="reserved"):
        log.tally("transfer.summary", 1, messages=3)
    with pytest.raises(ConfigError, match="max_bytes must be a positive number"):
        AuditLog(tmp_path / "a.jsonl", max_bytes=0)
    with pytest.raises(ConfigError, match="summary_interval must be a positive number"):
        AuditLog(tmp_path / "a.jsonl", summary_interval="10")
