"""Fixtures for every test: a test that leaves a child process behind fails (and the process is
killed, so it cannot disturb the next test). Helpers that tests share live in tests/support/."""
from __future__ import annotations

import os
import signal
import time

import pytest

from nebula.site.process import children

# One OpenMP thread for all the suite runs: its tests in each worker and the processes they start, which
# inherit it (a stage's own `threads` option still applies). With three workers on two cores a second
# thread mostly waits for a busy core (whole suite on H2: 595 s on two threads, 557 s on one).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children() -> set[int]:
    return children(os.getpid())


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = _children()
    yield
    deadline = time.monotonic() + 5
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"test left child processes behind: {sorted(left)}"


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (`item.rep_call`), so a fixture's teardown can print
    the logs of the processes it started when the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
