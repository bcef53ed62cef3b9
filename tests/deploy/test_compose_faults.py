"""Bad input and faults under a running Docker engine (issue 39): a missing credential directory, an empty one,
a port already taken, an unreadable data mount, a peer endpoint that does not resolve. Each ends in a state
`docker compose ps` (or `up` itself) shows, with the message the process or Docker gives, and nothing is
retried forever. Each fault is its own compose project of site a (its own name and published port), so none
disturbs another or the two-site check. Slow; skipped where no engine answers or the image is not built.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_compose_engine import docker, engine_or_skip, wait
from tests.support.compose import COMPOSE, compose_binary, compose_env, prepare_sites

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# Not the image's 10001: scripts/compose-check runs this file beside test_compose_engine.py, whose `down` test
# finds every process of 10001 on the host and must not see these.
UID = 10002


@pytest.fixture(scope="module")
def site_a(tmp_path_factory):
    """Site a as its operator prepares it (site b's half is made too, and unused)."""
    engine_or_skip()
    root = tmp_path_factory.mktemp("faults")
    return root, prepare_sites(root, steps=8, uid=UID)["a"]


class Fault:
    """One compose project of site a, named `nebula-fault-NAME`, with env overrides and extra compose files."""

    def __init__(self, name: str, env: dict[str, str], files: tuple[Path, ...] = ()):
        self.project, self.env, self.files = f"nebula-fault-{name}", env, files

    def compose(self, *args: str) -> subprocess.CompletedProcess:
        paths = [arg for f in (COMPOSE / "site-a.yaml", *self.files) for arg in ("-f", str(f))]
        return subprocess.run([str(compose_binary()), "-p", self.project, *paths, *args], env=compose_env(self.env),
                              capture_output=True, text=True, timeout=300)

    def inspect(self, service: str) -> dict:
        ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                     "--filter", f"label=com.docker.compose.service={service}").stdout.split()
        return json.loads(docker("inspect", *ids).stdout)[0] if ids else {}

    def ps(self) -> dict[str, tuple[str, str]]:
        rows = [json.loads(ln) for ln in self.compose("ps", "-a", "--format", "json").stdout.splitlines() if ln]
        return {r["Service"]: (r["State"], r["Health"]) for r in rows}

    def down(self) -> None:
        self.compose("down", "--timeout", "10")


@pytest.fixture
def fault(site_a, tmp_path):
    made = []

    def make(name: str, port: int, files: tuple[Path, ...] = (), **env: str) -> Fault:
        run = tmp_path / name
        (run / "audit").mkdir(parents=True)
        shutil.chown(run, UID, UID), shutil.chown(run / "audit", UID, UID)
        base = {**site_a[1], "NEBULA_COMPOSE_RUN": str(run), "NEBULA_COMPOSE_AUDIT": str(run / "audit"),
                "NEBULA_COMPOSE_PORT": str(port)}
        made.append(Fault(name, {**base, **env}, files))
        return made[-1]
    yield make
    for f in made:
        f.down()


def test_a_missing_credential_directory_is_refused_at_up_and_not_made(fault, tmp_path):
    nowhere = tmp_path / "no-credentials"
    f = fault("missing-credentials", 5621, NEBULA_COMPOSE_CREDENTIALS=str(nowhere))
    done = f.compose("up", "-d", "--no-build", "gateway")
    assert done.returncode != 0
    assert f"bind source path does not exist: {nowhere}/a.gateway.0" in done.stderr, done.stderr
    assert not nowhere.exists(), "compose made the missing directory (create_host_path)"
    assert f.inspect("gateway").get("State", {}).get("Running") is not True


def test_an_empty_credential_directory_ends_exited_with_the_process_message(fault, tmp_path):
    """The supervisor refuses to start (ConfigError; `nebula site up` exits 2 for its own errors, the "fix
    first" 3 being its services'): Docker tries it 3 more times (on-failure:3) and leaves it exited, where
    unless-stopped retried it forever."""
    empty = tmp_path / "empty-credentials"
    (empty / "a.gateway.0").mkdir(parents=True)
    f = fault("empty-credentials", 5622, NEBULA_COMPOSE_CREDENTIALS=str(empty))
    assert f.compose("up", "-d", "--no-build", "gateway").returncode == 0
    info = wait("the gateway to stop being restarted", lambda: (i := f.inspect("gateway"))["State"]["Status"]
                == "exited" and i["RestartCount"] == 3 and i, timeout=400, every=2)
    assert info["State"]["ExitCode"] == 2
    assert f.ps()["gateway"][0] == "exited"
    logs = f.compose("logs", "gateway").stdout
    assert "no credentials for a/gateway/0 in /etc/nebula/credentials/a.gateway.0" in logs, logs
    assert logs.count("no credentials for a/gateway/0") == 4, "one message per try: the first and 3 restarts"


def test_a_port_already_taken_is_refused_at_up_and_the_container_never_runs(fault):
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 5623))
        holder.listen()
        f = fault("port-taken", 5623)
        done = f.compose("up", "-d", "--no-build", "gateway")
    assert done.returncode != 0
    assert "0.0.0.0:5623: bind: address already in use" in done.stderr, done.stderr
    assert f.ps()["gateway"][0] == "created"
    assert f.inspect("gateway")["RestartCount"] == 0


def test_an_unreadable_data_mount_fails_the_stage_for_good_with_its_message(fault, tmp_path):
    """The stage exits 3 (its data cannot be read): the supervisor does not restart it and stays up, and the
    container reports the stage failed (`nebula health`, the healthcheck) instead of restarting it."""
    data = tmp_path / "data"
    shutil.copytree(Path(__file__).parents[1] / "e2e" / "data" / "es-en", data / "es-en")
    data.chmod(0o700)  # root's: the containers' uid cannot read it
    f = fault("unreadable-data", 5624, NEBULA_COMPOSE_DATA=str(data))
    assert f.compose("up", "-d", "--no-build").returncode in (0, 1)  # `up` itself may see the encoder fail
    status = Path(f.env["NEBULA_COMPOSE_RUN"]) / "status" / "supervisor.encoder.json"
    encoder = wait("the encoder to fail for good", lambda: next(
        (s for s in _services(status) if s["state"] == "failed"), None), timeout=400, every=2)
    assert encoder["exit_code"] == 3 and encoder["restarts"] == 0, encoder
    log = (Path(f.env["NEBULA_COMPOSE_RUN"]) / "logs" / "encoder.log").read_text()
    assert f"stage encoder cannot read /opt/nebula/data/es-en/train.src: permission denied to uid {UID}" in log
    info = f.inspect("encoder")
    assert info["State"]["Running"] and info["RestartCount"] == 0
    health = docker("exec", info["Id"], "nebula", "health", "/etc/nebula/site.toml", "--service", "encoder",
                    check=False)
    assert health.returncode != 0 and "failed" in health.stdout + health.stderr, health


def test_a_peer_endpoint_that_does_not_resolve_is_named_in_the_gateway_log(fault, tmp_path):
    """Not fatal: the gateway serves its own site and its other peers; ZeroMQ keeps retrying the name, which
    the gateway now says once instead of nothing."""
    config = tmp_path / "site-a.toml"
    config.write_text((COMPOSE / "site-a.toml").read_text().replace(
        'endpoint = "tcp://host.docker.internal:5700"', 'endpoint = "tcp://site-b.invalid:5700"'))
    override = tmp_path / "bad-peer.yaml"
    override.write_text(f"services:\n  gateway:\n    volumes:\n      - {{type: bind, source: {config}, "
                        "target: /etc/nebula/site.toml, read_only: true}\n")
    f = fault("bad-peer", 5625, files=(override,))
    assert f.compose("up", "-d", "--no-build", "gateway").returncode == 0
    log = Path(f.env["NEBULA_COMPOSE_RUN"]) / "logs" / "gateway.log"
    wait("the gateway to name the endpoint", lambda: "does not resolve" in _read(log), timeout=300, every=2)
    assert "tcp://site-b.invalid:5700 does not resolve" in _read(log) and "[peers.b] endpoint" in _read(log)
    assert f.inspect("gateway")["State"]["Running"]


def _services(state_file: Path) -> list[dict]:
    try:
        return json.loads(state_file.read_text())["services"]
    except (OSError, ValueError, KeyError):
        return []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
