"""Where an audit log's records live: the live file and its numbered archives.

A log configured as `audit/gateway.jsonl` is a *series* of files:

    audit/gateway.000001.jsonl   oldest archive (records seq 1 ..)
    audit/gateway.000002.jsonl   next archive, its first record chains to the last one of 000001
    audit/gateway.jsonl          the live file, the one being appended to

When the live file would grow past its size limit, it is renamed to the next number and a new live
file continues the chain. Archive numbers only grow and an archive is never renamed again, so a copy
shipped elsewhere keeps its name. The pattern is `<stem>.<number, 6 digits or more><suffix>`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from nebula.errors import DataError

DIGITS = 6
_ARCHIVE = re.compile(r"^(?P<stem>.+?)\.(?P<number>\d{%d,})(?P<suffix>\.[^.]*)?$" % DIGITS)  # noqa: UP031 - braces


def archive_path(base: Path, number: int) -> Path:
    """The name archive `number` of the series whose live file is `base` takes."""
    return base.with_name(f"{base.stem}.{number:0{DIGITS}d}{base.suffix}")


def archives(base: Path) -> list[tuple[int, Path]]:
    """(number, path) of every archive of `base`, oldest first."""
    pattern = re.compile(rf"^{re.escape(base.stem)}\.(\d{{{DIGITS},}}){re.escape(base.suffix)}$")
    try:
        names = os.listdir(base.parent)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), base.parent / name) for name in names if (m := pattern.match(name))]
    return sorted(found)


def series_files(base: Path) -> list[Path]:
    """Every file of the series, in chain order: the archives, then the live file if it exists."""
    return [path for _, path in archives(base)] + ([base] if base.is_file() else [])


def series_base(path: Path) -> Path:
    """The live file of the series `path` belongs to: `path` itself unless it names an archive."""
    match = _ARCHIVE.match(path.name)
    return path.with_name(match["stem"] + (match["suffix"] or "")) if match else path


def series_in(directory: Path) -> list[Path]:
    """The live-file paths of every `*.jsonl` series in `directory` (live file present or not)."""
    bases = set()
    for entry in directory.iterdir():
        if entry.is_file() and entry.name.endswith(".jsonl"):
            bases.add(series_base(entry))
    return sorted(bases)


def last_record(path: Path, fd: int | None = None) -> dict | None:
    """The last record of a file (None if it is empty); DataError if that line is cut short or not JSON."""
    own = fd is None
    fd = os.open(path, os.O_RDONLY) if fd is None else fd
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        line = _last_line(fd, size)
    finally:
        if own:
            os.close(fd)
    try:
        record = json.loads(line)
        int(record["seq"]), str(record["hash"])
        return record
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"audit log {path} ends with a partial or malformed record; "
                        f"run `nebula audit verify {path}` and move the file aside") from exc


def _last_line(fd: int, size: int) -> bytes:
    """The last newline-terminated line, reading backwards in growing chunks."""
    chunk = 4096
    while True:
        start = max(0, size - chunk)
        data = os.pread(fd, size - start, start)
        if not data.endswith(b"\n"):
            return data[data.rfind(b"\n") + 1:]  # torn last write: the caller reports it
        cut = data.rfind(b"\n", 0, len(data) - 1)
        if cut >= 0 or start == 0:
            return data[cut + 1:-1]
        chunk *= 4
