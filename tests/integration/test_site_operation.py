"""A site as its operator runs it when things go wrong (issue 41): a supervisor killed with SIGKILL, a
service that fails at start-up, a restart of one service, users' jobs at `site down`. Real processes,
real CURVE; what runs is checked in the process table, not in the state files."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula.runtime.job_file import write_job_file
from nebula.security.job_record import record_file
from nebula.site.process import ProcessId
from tests.support.gateways import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]


def nebula(*args, check: bool = True, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "nebula.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise AssertionError(f"nebula {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def example_job(path: Path, steps: int = 100000, site_b: str = "b") -> Path:
    """A light job: the example source at site a, its sink at `site_b` (a for a job within one site)."""
    write_job_file(path, {
        "job": {"name": "example"},
        "train": {"steps": steps, "batch_size": 8, "micro_batches": 2, "checkpoint_every": 2, "log_every": 1},
        "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                   "sink": {"address": f"{site_b}/sink/0", "impl": "example-sink"}},
        "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]})
    return path


def init(root: Path, name: str = "a", job: Path | None = None, *extra) -> tuple[Path, list[str]]:
    """`nebula site init`; -> the config, and the `site trust` line's arguments for the other operator."""
    public, internal = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    out = nebula("site", "init", name, "--site-dir", root / name, "--public", public, "--external", public,
                 "--internal", internal, "--days", 1, *(["--job", job] if job else []), *extra).stdout
    line = next(ln.split() for ln in out.splitlines() if ln.strip().startswith("nebula site trust"))
    return root / name / "site.toml", [str(root / name / line[4]), *line[5:]]


def trust(config: Path, line: list[str], *extra) -> subprocess.CompletedProcess:
    return nebula("site", "trust", config, *line, *extra)


def recorded(config: Path) -> list[ProcessId]:
    """Every process the site's supervisor recorded, with its start time, and the supervisor."""
    state = json.loads((config.parent / "run" / "status" / "supervisor.json").read_text())
    return [ProcessId(state["pid"], state["pid_start"])] + [
        ProcessId(pid, start) for s in state["services"] for pid, start in zip(s["pids"], s["pid_starts"])]


def status(config: Path) -> dict:
    return json.loads(nebula("site", "status", config, "--json").stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Site a, trusting site b (never started here): its stage `src` waits for b's sink, idle. Built
    once for the module (`site init` imports torch to read the job: seconds each)."""
    root = tmp_path_factory.mktemp("sites")
    job = example_job(root / "job.toml")
    config, _ = init(root, "a", job)
    trust(config, init(root, "b", job)[1])
    return config


@pytest.fixture
def site_a(built):
    config = built
    yield config
    nebula("site", "down", config, check=False)


def test_a_supervisor_killed_with_sigkill_leaves_services_that_down_stops_and_up_refuses_to_double(site_a):
    nebula("site", "up", site_a)
    supervisor, *services = recorded(site_a)
    os.kill(supervisor.pid, signal.SIGKILL)
    wait_for(lambda: not supervisor.alive(), timeout=10, what="the supervisor to die")
    assert services and all(p.alive() for p in services)  # the process table: its services run on
    seen = status(site_a)
    assert not seen["up"] and {s["service"]: s["state"] for s in seen["services"]} == \
        {"gateway": "orphaned", "src": "orphaned"}
    assert "its supervisor died and left gateway, src running" in nebula("site", "status", site_a).stdout
    again = nebula("site", "up", site_a, check=False)
    assert again.returncode != 0 and "site a is already up" in again.stderr
    assert f"gateway (pid {services[0].pid})" in again.stderr and "nebula site down" in again.stderr
    assert [p for p in recorded(site_a)[1:]] == services  # no second set was started
    down = nebula("site", "down", site_a)
    assert f"gateway (pid {services[0].pid})" in down.stdout and f"src (pid {services[1].pid})" in down.stdout
    assert not [p for p in services if p.alive()]
    assert "not up" in nebula("site", "down", site_a).stdout


def test_site_up_fails_with_the_services_reason_and_leaves_nothing_running(site_a):
    internal = int(site_a.read_text().split('internal = "tcp://127.0.0.1:')[1].split('"')[0])
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last test's TIME_WAIT
        holder.bind(("127.0.0.1", internal))
        holder.listen()
        done = nebula("site", "up", site_a, check=False)
    assert done.returncode != 0
    assert "gateway failed at start-up (exit code 3)" in done.stderr and "cannot bind" in done.stderr
    assert "is down again" in done.stderr
    assert not [p for p in recorded(site_a) if p.alive()]


def test_restart_one_service_and_wait_until_every_service_is_healthy(site_a):
    started = time.monotonic()
    nebula("site", "up", site_a, "--wait-healthy", 60)
    assert {s["service"]: s["state"] for s in status(site_a)["services"]} == {"gateway": "running", "src": "running"}
    assert nebula("health", site_a).returncode == 0
    before = {s["service"]: s["pid"] for s in status(site_a)["services"]}
    followed = site_a.parent / "followed.log"
    with open(followed, "w") as out_file:  # `site logs -f`, as an operator watches a restart
        follower = subprocess.Popen([sys.executable, "-m", "nebula.cli", "site", "logs", site_a, "gateway", "-n", "0",
                                     "-f"], cwd=REPO, stdout=out_file, stderr=subprocess.STDOUT)
    try:
        out = nebula("site", "restart", site_a, "--service", "gateway").stdout
        wait_for(lambda: "gateway a/gateway/0 up" in followed.read_text(), timeout=20, what="the new start's line")
    finally:
        follower.kill()
        follower.wait()
    after = {s["service"]: s for s in status(site_a)["services"]}
    assert f"restarted gateway (pid {after['gateway']['pid']})" in out and after["gateway"]["pid"] != before["gateway"]
    assert after["gateway"]["restarts"] == 1 and after["src"]["pid"] == before["src"]  # the others untouched
    assert not ProcessId(before["gateway"], None).alive()
    done = nebula("site", "restart", site_a, "--service", "nope", check=False)
    assert done.returncode != 0 and "runs no service 'nope'; it runs gateway, src" in done.stderr
    assert time.monotonic() - started < 60


def test_site_down_stops_a_users_running_job_too_and_says_so(site_a, tmp_path):
    secret = tmp_path / "alice.secret"
    secret.write_text("alice's long secret\n")
    secret.chmod(0o600)
    user = ("--site-config", site_a, "--secret-file", secret)
    nebula("user", "add", "alice", *user)
    job = tmp_path / "alice.toml"
    write_job_file(job, {"job": {"name": "alice"}, "train": {"steps": 100000, "batch_size": 8, "log_every": 50},
                         "stages": {"src": {"address": "a/alice-src/0", "impl": "example-source"},
                                    "sink": {"address": "a/alice-sink/0", "impl": "example-sink"}},
                         "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]})
    nebula("site", "up", site_a)
    job_id = nebula("job", "submit", job, "--user", "alice", *user).stdout.split()[1]
    workspace = site_a.parent / "run" / "jobs" / job_id
    record = record_file(workspace).read()
    state = json.loads((workspace / "status" / "supervisor.json").read_text())
    job_processes = [ProcessId(record["pid"], record["pid_start"])] + [
        ProcessId(pid, start) for s in state["services"] for pid, start in zip(s["pids"], s["pid_starts"])]
    assert all(p.alive() for p in job_processes)
    down = nebula("site", "down", site_a).stdout
    assert f"stopped job {job_id} of alice: supervisor (pid {record['pid']}), src" in down
    assert "stopped site a: supervisor" in down
    assert not [p for p in job_processes + recorded(site_a) if p.alive()]  # the process table
    listed = nebula("job", "list", "--user", "alice", *user).stdout
    assert listed.splitlines()[1].split()[:3] == [job_id, "alice", "stopped"]


@pytest.mark.slow  # four sites' worth of processes: ~2 min on 2 busy cores
def test_two_users_at_two_sites_run_the_halves_of_one_job_under_the_id_the_first_site_issued(tmp_path):
    """docs/operate.md §4 as written: two operators, alice at a and bob at b, the shipped job."""
    job = REPO / "deploy" / "jobs" / "example-two-users.toml"
    (a, line_a), (b, line_b) = init(tmp_path, "a", None, "--data", tmp_path), init(tmp_path, "b", None, "--data",
                                                                                    tmp_path)
    trust(a, line_b)
    trust(b, line_a)
    users = {}
    for config, user in ((a, "alice"), (b, "bob")):
        secret = tmp_path / f"{user}.secret"
        secret.write_text(f"{user}'s long secret\n")
        secret.chmod(0o600)
        users[user] = ("--user", user, "--site-config", config, "--secret-file", secret)
        (tmp_path / f"data-{user}").mkdir()
        nebula("user", "add", user, *users[user][2:])
        nebula("data", "register", "example", tmp_path / f"data-{user}", "--owner", user, *users[user][2:])
    try:
        for config in (a, b):
            nebula("site", "up", config)
        submitted = nebula("job", "submit", job, *users["alice"]).stdout
        job_id = submitted.split()[1]
        assert f"--join {job_id}" in submitted  # what alice tells bob
        wrong = nebula("job", "submit", job, "--join", job_id[:-8] + "0" * 8, *users["bob"], check=False)
        assert wrong.returncode != 0 and "issued for another job file" in wrong.stderr
        nebula("job", "submit", job, "--join", job_id, *users["bob"])
        followed = tmp_path / "followed.log"
        with open(followed, "w") as out_file:  # bob watches his half: `job logs -f`
            follower = subprocess.Popen([sys.executable, "-m", "nebula.cli", "job", "logs", job_id, *users["bob"],
                                         "--stage", "sink", "-f"], cwd=REPO, stdout=out_file, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "[sink] step=6" in followed.read_text(), timeout=120, what="bob's log to show step 6")
        finally:
            follower.kill()
            follower.wait()
        for user in ("alice", "bob"):
            wait_for(lambda u=user: _listed(users[u])[2] == "done", timeout=120, what=f"{user}'s half to end",
                     interval=1.0)
        row_a, row_b = _listed(users["alice"]), _listed(users["bob"])
        assert row_a[0] == row_b[0] == job_id
        assert "a/src/0 done step 6" in " ".join(row_a) and "b/sink/0 step 6" in " ".join(row_a)  # b's half, seen
        assert "b/sink/0 done step 6" in " ".join(row_b) and "a/src/0 step" in " ".join(row_b)
        logs = nebula("job", "logs", job_id, *users["bob"], "--stage", "sink", "-n", 200).stdout
        assert "[sink] step=6" in logs and "loss=" in logs and "checkpoint step=6" in logs
        assert (a.parent / "run" / "jobs" / job_id / "src" / "finished.json").exists()
    finally:
        for config in (a, b):
            nebula("site", "down", config, check=False)


def _listed(user: tuple) -> list[str]:
    """The first job's row of `nebula job list` (`user`: its arguments), split on whitespace."""
    return nebula("job", "list", *user).stdout.splitlines()[1].split()


def test_a_stage_that_finished_its_job_is_not_started_again_by_site_up(site_a):
    """A finished stage started again would evaluate again and wait for the other site (issue 41, 3)."""
    workdir = site_a.parent / "run" / "src"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "finished.json").write_text('{"steps": 100000}')  # as the runner leaves it (example_job's steps)
    try:
        nebula("site", "up", site_a)
        states = {s["service"]: s["state"] for s in status(site_a)["services"]}
        assert states == {"gateway": "running", "src": "done"}
        assert "src finished the job at step 100000 already; not started" in \
            nebula("site", "logs", site_a, "supervisor").stdout
        nebula("site", "down", site_a)
        nebula("site", "up", site_a, "--steps", 100001)  # --steps trains on
        assert {s["service"]: s["state"] for s in status(site_a)["services"]}["src"] == "running"
    finally:
        (workdir / "finished.json").unlink()
