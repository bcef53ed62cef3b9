"""`nebula site init | trust | up | status | logs | down` as two operators would run them: real
processes, real CURVE, the example job across two sites, each site from its own directory (the commands are
under test here; a real model's job across sites is the end-to-end tests')."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nebula.site.process import alive
from tests.support.gateways import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "e2e" / "jobs" / "example.toml"


def nebula(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "nebula.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"nebula {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def init(root: Path, name: str, job: Path | None = JOB) -> tuple[Path, str]:
    """`nebula site init`; returns the config and the trust line it printed for the other operator."""
    public, internal = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    out = nebula("site", "init", name, "--dir", root / name, "--public", public, "--external", public,
                 "--internal", internal, "--days", 1, *(["--job", job] if job else [])).stdout
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("nebula site trust"))
    return root / name / "site.toml", line


def trust(config: Path, line: str, bundle_dir: Path) -> None:
    args = line.split()[4:]  # nebula site trust THEIR_SITE.toml BUNDLE --endpoint E --fingerprint F
    nebula("site", "trust", config, bundle_dir / args[0], *args[1:])


def status(config: Path) -> dict:
    return json.loads(nebula("site", "status", config, "--json").stdout)


def service(config: Path, name: str) -> dict:
    return next(s for s in status(config)["services"] if s["service"] == name)


@pytest.fixture
def two_sites(tmp_path, request):
    job = getattr(request, "param", JOB)
    (a, line_a), (b, line_b) = init(tmp_path, "a", job), init(tmp_path, "b", job)
    trust(a, line_b, tmp_path / "b")
    trust(b, line_a, tmp_path / "a")
    yield a, b
    for config in (a, b):
        nebula("site", "down", config, check=False)


def test_two_operators_bring_up_a_job_watch_it_and_stop_it_cleanly(two_sites):
    a, b = two_sites
    assert "[peers.b]" in a.read_text() and "ca.key" not in {p.name for p in (a.parent / "credentials").rglob("*")}
    for config in (a, b):
        assert "up (supervisor pid" in nebula("site", "up", config).stdout
    # The job runs to its end at both sites; the gateways keep running.
    wait_for(lambda: service(a, "src")["state"] == "done" and service(b, "sink")["state"] == "done",
             timeout=240, what="the job to finish at both sites", interval=1.0)
    gateway, src = service(a, "gateway"), service(a, "src")
    assert gateway["state"] == "running" and gateway["restarts"] == 0 and gateway["uptime"] > 0
    assert src["step"] == 8 and src["step_s"] > 0  # what the stage reported in its status file
    assert src["bytes_out"] > 0 and src["bytes_in"] > 0  # activations out, gradients back
    assert service(b, "sink")["loss"] > 0  # the sink holds the loss
    assert (service(a, "gateway")["bytes_out"] or 0) > 0
    assert (a.parent / "run" / "src" / "checkpoints").is_dir()
    table = nebula("site", "status", a).stdout
    assert re.search(r"src\s+done", table) and re.search(r"gateway\s+running", table)
    # A crashed gateway is restarted with backoff; the supervisor keeps watching the rest.
    os.kill(gateway["pid"], signal.SIGKILL)
    wait_for(lambda: service(a, "gateway")["restarts"] == 1 and service(a, "gateway")["state"] == "running",
             timeout=20, what="the gateway's restart", interval=0.5)
    assert "gateway" in nebula("site", "logs", a, "gateway", "-n", "5").stdout
    pids = [p for s in json.loads((a.parent / "run" / "status" / "supervisor.json").read_text())["services"]
            for p in s["pids"]]
    supervisor = status(a)["supervisor_pid"]
    assert "site a down" in nebula("site", "down", a).stdout
    assert not alive(supervisor) and not any(alive(p) for p in pids)  # no orphan
    assert status(a)["up"] is False


@pytest.mark.parametrize("two_sites", [None], indirect=True)  # gateways only
def test_a_second_up_a_bad_config_and_a_ca_key_in_reach_are_refused(tmp_path, two_sites):
    a, _ = two_sites
    nebula("site", "up", a)
    assert [s["service"] for s in status(a)["services"]] == ["gateway"]
    again = nebula("site", "up", a, check=False)
    assert again.returncode != 0 and "already up" in again.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(a.read_text().replace("[gateway]", "[gateway]\nio_thread = 2"))
    done = nebula("site", "up", bad, check=False)
    assert done.returncode != 0
    assert f"{bad} [gateway]: unknown key 'io_thread' (did you mean 'io_threads'?)" in done.stderr
    nebula("site", "down", a)
    # A site config that hands the services the CA store: every service refuses to start.
    store = a.parent / "store.toml"  # beside site.toml: the same relative paths
    store.write_text(a.read_text().replace('credentials = "credentials"', 'credentials = "keys/a"'))
    done = nebula("gateway", "run", "--site-config", store, check=False, timeout=30)
    assert done.returncode == 3 and "ca.key" in done.stderr and "bundle-service" in done.stderr


def test_site_init_trust_refuses_a_wrong_fingerprint_and_a_clashing_name(tmp_path):
    a, line_a = init(tmp_path, "a")
    other = tmp_path / "other"
    _, line_a2 = init(other, "a")
    args = line_a2.split()[4:]
    done = nebula("site", "trust", a, other / "a" / args[0], *args[1:], check=False)
    assert done.returncode != 0 and "two sites cannot share a name" in done.stderr
    b, line_b = init(tmp_path, "b")
    args = line_b.split()[4:]
    args[-1] = "sha256:" + "0" * 32
    done = nebula("site", "trust", a, tmp_path / "b" / args[0], *args[1:], check=False)
    assert done.returncode != 0 and "do not trust it" in done.stderr
