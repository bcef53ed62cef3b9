"""The one writer of job files: a job's tables, checked as the loader will read them, then written.

Whoever makes or changes a job file (the launcher resolving ranks = "auto", the demo, the benchmarks,
the tests) reads its tables with read_job_table, changes them with override() and writes them with
write_job_file, which refuses what nebula.runtime.job.parse_job refuses before any file exists:

    table = read_job_table("deploy/jobs/abnet-es-en.toml")         # [job].data made absolute
    write_job_file(run / "job.toml", override(table, train={"steps": 20, "seed": 2}))
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from nebula.config import read_toml
from nebula.errors import ConfigError
from nebula.runtime.job import JobConfig, parse_job
from nebula.security.grants import PREFIX
from nebula.security.keyfile import write_atomic


def read_job_table(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of job file `path`, its [job].data (a directory relative to the file) made absolute,
    so that they can be written anywhere."""
    path = Path(path)
    table = read_toml(path, "job file")
    data = table.get("job", {}).get("data")
    if isinstance(data, str) and not data.startswith(PREFIX) and not Path(data).is_absolute():
        table["job"]["data"] = str((path.resolve().parent / data).resolve())
    return table


def override(table: Mapping[str, Any], *, job: Mapping[str, Any] | None = None,
             train: Mapping[str, Any] | None = None, schedule: Mapping[str, Any] | None = None,
             stages: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A copy of a job's `table` with these keys of its [job], [train], [schedule] and [stages.NAME]
    tables set (a stage must exist: a typo is an error, not a new stage)."""
    out = copy.deepcopy(dict(table))
    for key, values in (("job", job), ("train", train), ("schedule", schedule)):
        if values:
            out.setdefault(key, {}).update(values)
    for name, values in (stages or {}).items():
        if name not in out.get("stages", {}):
            raise ConfigError(f"no stage {name!r} to change in the job (it has {', '.join(out.get('stages', {}))})")
        out["stages"][name].update(values)
    return out


def job_text(table: Mapping[str, Any], note: str | None = None) -> str:
    """What write_job_file writes for `table`: `note` as a comment line, then the tables."""
    return (f"# {note}\n" if note else "") + tomli_w.dumps(dict(table))


def write_job_file(path: str | os.PathLike, table: Mapping[str, Any], note: str | None = None) -> JobConfig:
    """Check `table` as job file `path` will be read (relative paths relative to it), then write it
    there atomically, with `note` as its first line; -> the job as it will load."""
    path = Path(path)
    job = parse_job(copy.deepcopy(dict(table)), source=path)
    write_atomic(path, job_text(table, note).encode())
    return job
