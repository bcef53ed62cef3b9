"""Users' jobs with real processes: a real gateway, `nebula job submit` starting a detached supervisor
whose stages talk CURVE through it, read their data set through a grant, and are stopped; another
user, with a real secret, tries to read, stop and impersonate."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from nebula.runtime.job_file import write_job_file
from nebula.security.accounts import Accounts
from nebula.security.audit import verify
from nebula.security.grants import DataRegistry
from nebula.security.keystore import SiteKeyStore
from nebula.site.config import load_site_config
from nebula.site.jobs import Site, record_file, stop
from nebula.site.process import alive, cmdline
from nebula.site.service import tail
from nebula.site.site import site_services
from nebula.site.supervisor import Supervisor
from tests.support.accounts import cli_runner, make_site, secret_file

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"alice": "alice's long secret", "bob": "bob's long secret"}


def job_file(path: Path, steps: int, data: str | None = "dataset:corpus", prefix: str = "") -> Path:
    write_job_file(path, {
        "job": {"name": "iso", **({"data": data} if data else {})},
        "train": {"steps": steps, "batch_size": 8, "micro_batches": 2, "checkpoint_every": 1000, "log_every": 1},
        "stages": {"src": {"address": f"a/{prefix}src/0",
                           "impl": "tests.support.jobs:DataSource" if data else "example-source"},
                   "sink": {"address": f"a/{prefix}sink/0", "impl": "example-sink"}},
        "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]})
    return path


@pytest.fixture
def site(tmp_path, monkeypatch, capsys):
    """Site a with its gateway running, users alice (owner of data set `corpus`) and bob."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the stages import tests.support.jobs
    for name in ("NEBULA_JOB_ID", "NEBULA_USER"):
        monkeypatch.delenv(name, raising=False)
    config = make_site(tmp_path)
    loaded = load_site_config(config)
    for user, secret in SECRETS.items():
        Accounts(loaded.ca).add(user, secret)
        secret_file(tmp_path / f"{user}.secret", secret)
    (tmp_path / "data" / "corpus").mkdir()
    (tmp_path / "data" / "corpus" / "train.txt").write_text("hola mundo\n")
    DataRegistry(loaded.ca).register("corpus", tmp_path / "data" / "corpus", "alice", loaded.data)
    gateway = Supervisor()  # as `nebula site up` starts it
    gateway.start(*site_services(loaded, config, only="gateway"))
    run = cli_runner(monkeypatch, capsys, ["job"])

    def nebula(user: str, *args: str) -> tuple[int, str, str]:
        """`nebula ARGS --site-config CONFIG` with `user`'s secret file."""
        return run(*args, "--site-config", str(config), "--secret-file", str(tmp_path / f"{user}.secret"))
    try:
        yield nebula, loaded
    finally:
        for record in Site.load(config).records():  # a failed test leaves no job behind
            if record["state"] in ("starting", "running"):
                stop(Site.load(config), record["id"], record["owner"], SECRETS[record["owner"]])
        gateway.stop()


def submitted(out: str) -> str:
    assert out.startswith("job "), out
    return out.split()[1]


def wait_state(site, job_id: str, states: tuple[str, ...], timeout: float = 60) -> dict:
    directory = site.run / "jobs" / job_id
    deadline = time.monotonic() + timeout
    while (record := record_file(directory).read())["state"] not in states:
        log = tail(directory / "logs" / "src.log")
        assert time.monotonic() < deadline, f"job {job_id} is {record['state']}:\n{log}"
        time.sleep(0.2)
    return record


def audit_events(site, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (site.ca / "audit.jsonl").read_text().splitlines()) if r["event"] == kind]


def test_a_job_runs_in_its_own_workspace_reads_through_its_grant_and_only_its_owner_sees_it(site, tmp_path):
    nebula, config = site
    path = job_file(tmp_path / "job.toml", steps=4)
    code, out, err = nebula("alice", "job", "submit", str(path), "--user", "alice")
    assert code == 0, err
    job_id = submitted(out)
    record = wait_state(config, job_id, ("done", "failed"))
    directory = Path(record["dir"])
    assert record["state"] == "done", tail(directory / "logs" / "supervisor.log")
    assert (directory / "src" / "data-files.txt").read_text() == "train.txt\n"  # opened through the grant
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert record["config_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not list(directory.rglob("ca.key")) and not list((config.ca / "keys").glob("a.src.0*"))
    submit, = audit_events(config, "job.submitted")
    assert submit["owner"] == "alice" and submit["code_sha256"] == record["code_sha256"]
    read, = audit_events(config, "data.read")
    assert (read["job"], read["user"], read["dataset"]) == (job_id, "alice", "corpus")
    assert set(record["serials"]) <= set(SiteKeyStore(config.ca).crl().revoked)  # the keys died with the job

    code, _, err = nebula("bob", "job", "logs", job_id, "--user", "bob")
    assert code == 2 and f"job {job_id} belongs to another user" in err
    code, _, err = nebula("bob", "job", "logs", job_id, "--user", "alice")  # bob's secret, alice's name
    assert code == 2 and "wrong secret for user alice" in err
    code, out, _ = nebula("alice", "job", "logs", job_id, "--user", "alice", "--stage", "src")
    assert code == 0 and out.startswith("== src ==")
    code, out, _ = nebula("bob", "job", "list", "--user", "bob")
    assert code == 0 and job_id not in out
    assert [(e["user"], e["reason"]) for e in audit_events(config, "job.refused")] == [("bob", "not the owner")]
    assert audit_events(config, "account.auth_failed")[-1]["purpose"] == "job.logs"
    assert verify(config.ca / "audit.jsonl").ok


def test_a_running_job_holds_its_addresses_and_only_its_owner_stops_it(site, tmp_path):
    nebula, config = site
    code, out, err = nebula("alice", "job", "submit", str(job_file(tmp_path / "long.toml", steps=100000)),
                            "--user", "alice")
    assert code == 0, err
    job_id = submitted(out)
    record = wait_state(config, job_id, ("running",))
    code, _, err = nebula("bob", "job", "submit", str(job_file(tmp_path / "bob.toml", 5, data=None)), "--user", "bob")
    assert code == 2 and f"address a/src/0 is held by job {job_id} (user alice, running)" in err
    code, _, err = nebula("bob", "job", "stop", job_id, "--user", "bob")
    assert code == 2 and "belongs to another user" in err
    state = json.loads((Path(record["dir"]) / "status" / "supervisor.json").read_text())
    pids = [pid for s in state["services"] for pid in s["pids"]] + [record["pid"]]
    assert all(alive(pid) for pid in pids)  # bob's attempt changed nothing
    code, out, err = nebula("alice", "job", "stop", job_id, "--user", "alice")
    assert code == 0 and "stopped" in out, err
    assert not [(pid, cmdline(pid)) for pid in pids if alive(pid)]
    code, out, _ = nebula("alice", "job", "list", "--user", "alice")
    assert code == 0 and out.splitlines()[1].split()[:3] == [job_id, "alice", "stopped"]


def test_a_job_whose_supervisor_was_killed_is_lost_and_stop_still_cleans_up(site, tmp_path):
    nebula, config = site
    code, out, err = nebula("alice", "job", "submit", str(job_file(tmp_path / "long.toml", steps=100000)),
                            "--user", "alice")
    assert code == 0, err
    record = wait_state(config, submitted(out), ("running",))
    state = json.loads((Path(record["dir"]) / "status" / "supervisor.json").read_text())
    stages = [pid for s in state["services"] for pid in s["pids"]]
    os.kill(record["pid"], signal.SIGKILL)  # the stages go on, orphaned, with valid certificates
    while alive(record["pid"]):
        time.sleep(0.05)
    code, out, _ = nebula("alice", "job", "list", "--user", "alice")
    assert code == 0 and out.splitlines()[1].split()[2] == "lost" and all(alive(pid) for pid in stages)
    code, out, err = nebula("alice", "job", "stop", record["id"], "--user", "alice")
    assert code == 0 and "stopped" in out, err
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in stages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in stages)
    assert set(record["serials"]) <= set(SiteKeyStore(config.ca).crl().revoked)


def test_a_job_without_a_grant_is_refused_at_submit_and_a_plain_path_is_not_allowed(site, tmp_path):
    nebula, config = site
    code, _, err = nebula("bob", "job", "submit", str(job_file(tmp_path / "j.toml", 4)), "--user", "bob")
    assert code == 2 and "user:bob holds no grant on data set corpus" in err
    code, _, err = nebula("alice", "job", "submit", str(job_file(tmp_path / "p.toml", 4, data=str(tmp_path))),
                          "--user", "alice")
    assert code == 2 and "a submitted job reads data only through a grant" in err
    assert audit_events(config, "data.refused")[-1]["reason"] == "no grant"
    assert not (config.run / "jobs").exists() or not any((config.run / "jobs").iterdir())

