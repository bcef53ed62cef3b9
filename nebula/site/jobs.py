"""Users' jobs at one site: a workspace, short-lived certificates and a supervisor process per job.

    <run>/jobs/<id>/              0700, one per job
        job.json                  the record: owner, code and config hashes, stages, state (nebula-job/1)
"""
from __future__ import annotations

import json
from pathlib import Path

RECORD_FORMAT = "nebula-job/1"


def job_dir(run: Path, job_id: str) -> Path:
    return Path(run) / "jobs" / job_id


def job_owner(run: Path, job_id: str) -> str | None:
    """The user a job of this site belongs to, or None if there is no such job."""
    try:
        record = json.loads((job_dir(run, job_id) / "job.json").read_text())
    except (OSError, ValueError):
        return None
    return record.get("job", {}).get("owner") if record.get("format") == RECORD_FORMAT else None
