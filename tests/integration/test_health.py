"""A real gateway process with its status file and Prometheus endpoint on (as `nebula site up` starts
it): `nebula health` passes while it runs, by file, by site config and by address; a scrape over HTTP
finds the messages it routed per peer, the same numbers its status file shows; killed, it fails health;
stopped, it says so; a metrics port in use stops it with an error naming the port."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from nebula.observe.status import read_status
from nebula.site.channel import open_channel
from nebula.wire import Kind, Message, TensorPayload
from tests.support.gateways import FAST, REPO, GatewayProcess, free_port, make_world, wait_for


def health(*args: str) -> subprocess.CompletedProcess:
    """`nebula health ARGS` as an operator runs it (without the gateway's variables: NEBULA_SERVICE would
    be --service's default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    return subprocess.run([sys.executable, "-m", "nebula.cli", "health", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (labels in any order), or None."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == labels:
            return float(match.group(2))
    return None


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Site a (two local stages), with the variables the supervisor sets for its gateway."""
    site = make_world(tmp_path, stages=("a/enc/0", "a/dec/0", "b/dec/0")).site("a")
    site.status, site.metrics_port = site.config.run / "status" / "gateway.json", free_port()
    monkeypatch.setenv("NEBULA_SERVICE", "gateway")
    monkeypatch.setenv("NEBULA_STATUS_FILE", str(site.status))
    monkeypatch.setenv("NEBULA_METRICS_PORT", str(site.metrics_port))
    return site


def send_through(site, n: int) -> None:
    """`n` tensor messages a/enc/0 -> a/dec/0, through the gateway."""
    data = torch.arange(64, dtype=torch.float32)
    with open_channel(site.config, "a/enc/0", config=FAST) as enc, \
            open_channel(site.config, "a/dec/0", config=FAST) as dec:
        for step in range(n):
            tensor = TensorPayload("h", "activation", "float32", (64,), "none", b"", [data])
            enc.send(Message(kind=Kind.TENSORS, job="j", dst="a/dec/0", step=step, tensors=[tensor]), timeout=5)
        assert [dec.recv(timeout=10).step for _ in range(n)] == list(range(n))


def test_health_and_metrics_of_a_running_gateway_then_a_killed_one(site, tmp_path):
    before = health(str(site.config_path))
    assert before.returncode == 1 and "no service has written a status file" in before.stdout
    gateway = GatewayProcess(site).start()
    try:
        for args in ([str(site.status)], [str(site.config_path), "--service", "gateway"],
                     ["a/gateway/0", "--site-config", str(site.config_path)]):
            checked = health(*args)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            assert checked.stdout.startswith(f"healthy: gateway running: pid {gateway.proc.pid}")
        send_through(site, 5)

        def same_numbers():  # the scrape and the file agree once the traffic has been written out
            text = scrape(site.metrics_port)
            got = sample(text, "nebula_gateway_messages_total", peer="a/enc/0", direction="in")
            # and out: on a loaded host (CI beside training, load 8) a scrape came between a message counted in
            # and the same message counted out
            out = sample(text, "nebula_gateway_bytes_total", peer="a/dec/0", direction="out") or 0
            peers = read_status(site.status)["peers"]
            return text if got and got >= 5 and got == peers["a/enc/0"]["messages_in"] and out >= 5 * 256 else None
        text = wait_for(same_numbers, timeout=10, what="the gateway's counters in the scrape and the file")
        assert sample(text, "nebula_service_info", service="gateway", kind="gateway", address="a/gateway/0") == 1
        assert sample(text, "nebula_gateway_queue_depth", socket="internal") is not None
        assert "process_resident_memory_bytes" in text
    finally:
        gateway.kill()
    dead = health(str(site.status))
    assert dead.returncode == 1 and f"pid {gateway.proc.pid} is not running" in dead.stdout


def test_a_stopped_gateway_says_so_and_a_busy_metrics_port_is_named(site, tmp_path):
    gateway = GatewayProcess(site).start()
    assert gateway.terminate() == 0
    assert read_status(site.status)["state"] == "stopped"
    stopped = health(str(site.config_path), "--json")
    assert stopped.returncode == 1 and "gateway is stopped" in stopped.stdout
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", site.metrics_port))
        holder.listen()
        argv = [sys.executable, "-m", "nebula.cli", "gateway", "run", "--site-config", str(site.config_path)]
        refused = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert f"metrics port {site.metrics_port} on 127.0.0.1 is already in use" in refused.stderr
    assert read_status(site.status)["state"] == "failed"
