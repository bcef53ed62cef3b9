"""Where a submitted job's record lives and whom the job belongs to.

    <run>/jobs/<id>/job.json   {"format": "nebula-job/1", "job": {"id", "owner", "state", ...}}

`nebula job submit` (nebula.site.jobs) writes the record; the data grants (nebula.security.grants)
read its owner to check a job principal's claim. The layout lives here, below both, so that the
security layer never imports the site tooling that runs jobs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from nebula.errors import ConfigError
from nebula.security.accounts import RecordFile

RECORD_FORMAT = "nebula-job/1"
_JOB = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def check_job_id(job: str) -> str:
    if not isinstance(job, str) or not _JOB.fullmatch(job):
        raise ConfigError(f"job id {job!r} is not a job id (see `nebula job list`)")
    return job


def job_dir(run: Path, job_id: str) -> Path:
    return Path(run) / "jobs" / check_job_id(job_id)  # checked: an id never walks out of jobs/


def record_file(directory: Path) -> RecordFile:
    return RecordFile(Path(directory) / "job.json", RECORD_FORMAT, "job")


def job_owner(run: Path, job_id: str) -> str | None:
    """The user a job of this site belongs to, or None if there is no such job. `run` is the site's
    run directory, or the job's workspace itself: the run directory of the site config its stages get."""
    run = Path(run)
    record_path = (run if run.name == job_id and run.parent.name == "jobs" else job_dir(run, job_id)) / "job.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    return record.get("job", {}).get("owner") if record.get("format") == RECORD_FORMAT else None
