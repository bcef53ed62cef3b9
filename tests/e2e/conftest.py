"""Fixtures for the e2e tests: whole jobs as real processes (tests/support/sites.py). A test that leaves a
process behind fails (tests/conftest.py); the log tails of every service are printed when a test fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.sites import Sites


@pytest.fixture
def start_job(tmp_path, request):
    """Factory: start_job(job_file, **kw) -> started Sites; all are stopped at teardown."""
    started: list[Sites] = []

    def start(job_file: Path, **kwargs) -> Sites:
        sites = Sites(tmp_path / f"run{len(started)}", job_file, **kwargs)
        started.append(sites)
        return sites

    yield start
    for sites in started:
        sites.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for sites in started:
            print(sites.tails(40))
