"""A site of several hosts under Docker (issue 39): ELECTRA's discriminator with its two data-parallel ranks in
two containers of site b (deploy/compose/electra-b.yaml), started as torchrun starts a multi-node job
(--nnodes 2, the c10d rendezvous at disc-0), the generator at site a (electra-a.yaml). The job trains to its
end; rank 0's all_reduce partner is the other host; only the gateways publish, and rank 1 holds no credentials
and reaches nothing outside its site. Slow; skipped where no engine answers or the image is not built.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_compose_engine import CONNECT, PORTS, UID, docker, engine_or_skip, port_taken, wait
from tests.support.compose import COMPOSE, REPO, compose_binary, compose_env, prepare_sites

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two projects up, then a job's steps

STEPS = 8
# seconds a micro-batch of each rank takes (the emulated device of services/electra/device.py): the tiny job's 8
# steps took ~0.2 s, over before the first health check (10 s after a container starts), so `up --wait` saw
# rank 1's container exit (0) and failed; at 6 s a step the job runs ~50 s, past the checks and long enough to
# sample each host's TCP peers every 2 s
DEVICE_TIME = 6.0
FILES = {"a": ["site-a.yaml", "electra-a.yaml"], "b": ["site-b.yaml", "electra-b.yaml"]}
STAGES = {"a": ["generator"], "b": ["disc-0", "disc-1"]}


def electra_job(root: Path) -> tuple[Path, Path]:
    """The tiny ELECTRA job of the e2e tests with the discriminator's two ranks, as electra-two-hosts.toml; its
    data a copy of the tiny corpora with the shared vocabulary built (the containers mount it read-only)."""
    from nebula.runtime.job import load_job
    from services.electra import data as electra_data

    data = root / "data"
    for corpus in ("es-en", "zh-en"):
        shutil.copytree(REPO / "tests" / "e2e" / "data" / corpus, data / corpus)
    text = (REPO / "tests" / "e2e" / "jobs" / "electra.toml").read_text()
    text = text.replace('data = "../data"', 'data = "../../data"').replace("\nsteps = 8\n", f"\nsteps = {STEPS}\n")
    text = text.replace('impl = "electra-discriminator"\n',
                        f'impl = "electra-discriminator"\nranks = 2\ndevice_time = {DEVICE_TIME}\n')
    (root / "jobs").mkdir()
    job = root / "jobs" / "electra-two-hosts.toml"
    job.write_text(text)
    options = load_job(job).stage("disc").options  # the vocabulary the stages will look for
    electra_data.load_vocab(data, options.vocab_corpora, options.vocab_file, electra_data.tokenizer())
    return job, data


def compose(envs, site: str, *args: str, check: bool = True) -> str:
    files = [arg for name in FILES[site] for arg in ("-f", str(COMPOSE / name))]
    done = subprocess.run([str(compose_binary()), *files, *args], env=compose_env(envs[site]),
                          capture_output=True, text=True, timeout=600)
    assert not check or done.returncode == 0, \
        f"compose {site} {' '.join(args)}:\n{done.stderr[-3000:]}\n{site_logs(site)}"
    return done.stdout


def site_logs(site: str) -> str:
    """The last lines of every container of the site's project: what `up --wait` does not say of one that exited
    (the test's cleanup removes them)."""
    ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project=nebula-site-{site}").stdout.split()
    out = []
    for cid in ids:
        done = docker("logs", "--tail", "30", cid, check=False)
        name = json.loads(docker("inspect", cid).stdout)[0]["Name"]
        out.append(f"--- {name}:\n{(done.stdout + done.stderr)[-2500:]}")
    return "\n".join(out)


def container(site: str, service: str) -> dict:
    ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project=nebula-site-{site}",
                 "--filter", f"label=com.docker.compose.service={service}").stdout.split()
    return json.loads(docker("inspect", *ids).stdout)[0]


def test_the_discriminator_trains_with_its_ranks_on_two_hosts(tmp_path):
    engine_or_skip()
    assert not [p for p in PORTS.values() if port_taken(p)], "the gateways' ports are in use on this host"
    job, data = electra_job(tmp_path)
    envs = prepare_sites(tmp_path, uid=UID, job=job, data=data)
    status = Path(envs["b"]["NEBULA_COMPOSE_RUN"]) / "status" / "disc.json"
    try:
        for site in ("a", "b"):
            compose(envs, site, "up", "-d", "--no-build", "--wait", "--wait-timeout", "300")
        check_isolated()
        peers: dict[str, set[str]] = {name: set() for name in STAGES["b"]}
        addresses: dict[str, set[str]] = {name: set() for name in (*STAGES["b"], "gateway")}

        def finished() -> str | None:  # samples each disc host's TCP peers and addresses while the job runs
            for name in addresses:  # an exited container has none: the ranks exit when the job is done
                info = container("b", name)
                addresses[name] |= _ips(info)
                if name in peers:
                    peers[name] |= tcp_peers(info["Id"])
            return _state(status) in ("done", "failed") and _state(status)
        state = wait("the discriminator to finish", finished, timeout=600, every=2)
        logs = {name: docker("logs", container("b", name)["Id"], check=False).stderr for name in STAGES["b"]}
        assert state == "done", logs
        check_hosts(envs, addresses)
        check_traffic(peers, addresses)
    finally:
        for site in ("a", "b"):
            compose(envs, site, "down", "--timeout", "60", check=False)
    ledger = json.loads((Path(envs["b"]["NEBULA_COMPOSE_RUN"]) / "disc" / "ledger.json").read_text())["steps"]
    assert [step for step, _ in ledger] == list(range(1, STEPS + 1))


def check_hosts(envs, addresses: dict[str, set[str]]) -> None:
    """The two ranks are two hosts (containers, each its own address seen while they ran), rank 1 holds no
    credentials; only the gateways publish a port."""
    disc0, disc1 = container("b", "disc-0"), container("b", "disc-1")
    assert (disc0["Config"]["Hostname"], disc1["Config"]["Hostname"]) == ("disc-0", "disc-1")
    assert addresses["disc-0"] and addresses["disc-1"] and not addresses["disc-0"] & addresses["disc-1"], addresses
    for info in (disc0, disc1):
        assert not any(info["NetworkSettings"]["Ports"].values()), info["Name"]
        assert info["Config"]["User"] == f"{UID}:{UID}" and info["HostConfig"]["ReadonlyRootfs"]
    assert not [m for m in disc1["Mounts"] if "credentials" in m["Destination"]]


def check_isolated() -> None:
    """Rank 1 reaches no other site: run inside its container while the job runs (an exited one runs nothing)."""
    gateway_a = container("a", "gateway")
    targets = [f"{n['IPAddress']}:{PORTS['a']}" for n in gateway_a["NetworkSettings"]["Networks"].values()]
    done = docker("exec", container("b", "disc-1")["Id"], "python3", "-c", CONNECT, *targets)
    tried = json.loads(done.stdout)
    assert tried and "open" not in tried.values(), done.stdout + done.stderr


def tcp_peers(container_id: str) -> set[str]:
    """The addresses this container's established TCP connections go to (its own /proc/net/tcp)."""
    done = docker("exec", container_id, "cat", "/proc/net/tcp", check=False)
    peers = set()
    for line in done.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "01":  # ESTABLISHED
            remote = bytes.fromhex(fields[2].split(":")[0])[::-1]  # little-endian IPv4
            peers.add(".".join(map(str, remote)))
    return peers - {"127.0.0.1"}


def check_traffic(peers: dict[str, set[str]], ip: dict[str, set[str]]) -> None:
    """The gradients cross the hosts: each rank held a connection to the other (gloo's all_reduce and the
    scatter/gather groups; with micro_batches = 2 each rank computes one of a step's two micro-batches, so
    every step's update needs the other host's gradient). And the stage's traffic to other sites goes only
    through its gateway: rank 0's peers are rank 1 and b's gateway, rank 1's only rank 0."""
    print("TCP peers seen:", {k: sorted(v) for k, v in peers.items()}, "addresses:", ip)
    assert peers["disc-0"] & ip["disc-1"] and peers["disc-1"] & ip["disc-0"], (peers, ip)
    assert peers["disc-0"] <= ip["disc-1"] | ip["gateway"], (peers, ip)
    assert peers["disc-1"] <= ip["disc-0"], (peers, ip)


def _ips(info: dict) -> set[str]:
    return {n["IPAddress"] for n in info["NetworkSettings"]["Networks"].values() if n["IPAddress"]}


def _state(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("state")
    except (OSError, ValueError):
        return None

