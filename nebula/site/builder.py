"""The one site builder: a site's CA, its gateway's and stages' certificates, trust between sites, and
its site config, written through nebula.site.config's one writer (write_site_config).

    build_site(path, config, stages)       a new site: CA store, certificates, credentials, site.toml
    init_site(name, dir, public, ...)      `nebula site init`: build_site in an operator's directory, and its bundle
    trust_site(path, bundle, endpoint, ..)  a peer's bundle imported (its fingerprint checked) and its [peers.X]
    job_credentials(config, root, ...)     a submitted job's own certificates, keys outside the CA store
    local_sites(root, names, ...)          several sites on one host that trust each other (demos, tests,
                                           benchmarks: every CA in one place, never for a deployment)

`nebula site init` and `site trust`, `nebula job submit` and nebula.site.local (the demo, the tests,
the benchmarks) all build their sites here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nebula.config import build
from nebula.errors import AuthError, ConfigError
from nebula.security.bundle import parse_bundle
from nebula.security.certs import Certificate, address_filename, check_site_name, parse_address
from nebula.security.credentials import publish_site
from nebula.security.keyfile import read_json, write_atomic, write_json
from nebula.security.keys import fingerprint, parse_fingerprint
from nebula.security.keystore import SiteKeyStore
from nebula.site.config import (
    MetricsConfig,
    SiteConfig,
    StagesConfig,
    gateway_config,
    load_site_config,
    peer_config,
    write_site_config,
)
from nebula.site.ports import free_port
from nebula.transport.config import ChannelConfig, check_endpoint


def build_site(path: Path, config: SiteConfig, stages: Iterable[str] = (), days: float = 30) -> SiteKeyStore:
    """A new site: its CA store at `config.ca`, certificates for its gateway and the stage addresses
    `stages`, every service's credential directory, and the config written at `path`."""
    if config.ca is None or config.ca.name != config.name:
        raise ConfigError(f"site {config.name}: its CA store must be a directory named {config.name} "
                          f"(e.g. keys/{config.name}), not {config.ca}")
    store = SiteKeyStore.init(config.ca.parent, config.name)
    store.issue(config.gateway.address, "gateway", days)
    for address in stages:
        store.issue(address, "stage", days)
    publish_site(store.dir, config.credentials)
    write_site_config(path, config)
    return store


def init_site(name: str, out: Path, public: str, external: str | None, internal: str, job: Path | None,
              days: float, stage_addresses: Sequence[str] = (), *, data: Sequence[Path] = (),
              metrics_port: int = 0) -> str:
    """`nebula site init`: under `out`, site.toml, keys/<name>/ (the CA store: keep it off service hosts),
    credentials/<address>/ per service, run/ and <name>.bundle.json (what other sites import); -> the
    line another site's operator runs to trust this one. `stage_addresses`: those of `job`'s stages at
    this site (its caller loaded the job), certified now. The fingerprint in that line is what the two
    operators compare out of band: `trust_site` refuses a bundle whose CA has another one."""
    out = Path(out).resolve()
    check_site_name(name)
    path = out / "site.toml"
    if path.exists():
        raise ConfigError(f"{path} exists: site {name} was initialised there already; pick another --dir, or keep "
                          "using it")
    port = public.rsplit(":", 1)[-1]
    gateway = gateway_config(name, {"internal": internal, "external": external or f"tcp://0.0.0.0:{port}",
                                    "public": public}, f"{path} [gateway]")  # mistakes before any key exists
    roots = tuple(Path(d).resolve() for d in data)
    missing = [str(d) for d in roots if not d.is_dir()]
    if missing:
        raise ConfigError(f"--data {missing[0]} is not a directory; create it (data sets are registered under it) "
                          "or name another")
    metrics = build(MetricsConfig, {"port": metrics_port}, "--metrics-port")
    config = SiteConfig(name=name, ca=out / "keys" / name, credentials=out / "credentials", run=out / "run",
                        audit=out / "run" / "audit" / "gateway.jsonl", gateway=gateway, data=roots, metrics=metrics,
                        stages=StagesConfig(job=Path(job).resolve()) if job is not None else StagesConfig())
    store = build_site(path, config, stage_addresses, days)
    bundle = export_bundle(store, out / f"{name}.bundle.json")
    return (f"nebula site trust THEIR_SITE.toml {bundle.name} --endpoint {public} "
            f"--fingerprint {fingerprint(store.ca_public())}")


def export_bundle(store: SiteKeyStore, out: Path) -> Path:
    """What other sites import to trust this one (CA key, gateway certificate, revocation list)."""
    write_json(out, store.export_bundle().to_dict())
    return out


def trust_site(path: Path, bundle_path: Path, endpoint: str, expected: str, replace: bool = False,
               force: bool = False) -> str:
    """Import a peer's bundle into this site's CA store (checking the fingerprint the operators
    compared), add its [peers.X] to the config (a changed endpoint only with `force`), refresh the
    services' credentials; -> the peer's name."""
    site = load_site_config(path)
    check_endpoint(endpoint, "--endpoint")
    expected = parse_fingerprint(expected)
    if site.ca is None:
        raise ConfigError(f"{path}: [site].ca is not set; trust is imported into the CA store on the operator's host")
    data = read_json(Path(bundle_path), missing="the bundle file the other site's operator sent you: check its path")
    bundle = parse_bundle(data, str(bundle_path))
    if bundle.fingerprint != expected:
        raise AuthError(f"{bundle_path}: CA fingerprint {bundle.fingerprint}, not {expected} as confirmed with "
                        f"site {bundle.site}'s operator; do not trust it (ask them for the right bundle)")
    if bundle.site == site.name:
        raise ConfigError(f"{bundle_path} claims site {site.name}, this site's own name: two sites cannot share "
                          "a name; one of them must `site init` under another")
    known = site.peers.get(bundle.site)
    if known is not None and known.endpoint != endpoint and not force:  # the operator's value: never silently
        raise ConfigError(f"{path}: [peers.{bundle.site}] endpoint is {known.endpoint!r}, not {endpoint!r}; "
                          f"if site {bundle.site} moved, run this again with --force to change it")
    SiteKeyStore(site.ca).trust(data, str(bundle_path), replace=replace)
    if known is None or known.endpoint != endpoint:
        peer = (peer_config(bundle.site, {"endpoint": endpoint}, str(path)) if known is None
                else dataclasses.replace(known, endpoint=endpoint))
        write_site_config(path, dataclasses.replace(site, peers={**site.peers, bundle.site: peer}))
    publish_site(site.ca, site.credentials)
    return bundle.site


def trust_each_other(stores: Sequence[SiteKeyStore], bundles: Path) -> None:
    """Every store trusts every other, through bundles written under `bundles` (sites on one host)."""
    for store in stores:
        bundle = export_bundle(store, bundles / f"{store.site}.bundle.json")
        for other in stores:
            if other is not store:
                other.trust(read_json(bundle), str(bundle))


def job_credentials(config: SiteConfig, root: Path, addresses: Iterable[str], days: float) -> Iterator[Certificate]:
    """A submitted job's own certificate per stage address, each key written beside the site's public
    trust under root/<address>/ (never into the CA store, never with ca.key); yields each certificate as
    it is issued, so a caller can record it before the next (and revoke it should a later one fail)."""
    assert config.ca is not None  # a site that takes jobs has its CA store here (nebula.security.accounts)
    store = SiteKeyStore(config.ca)
    for address in addresses:
        out = root / address_filename(address)
        out.mkdir(parents=True, mode=0o700)
        yield store.issue(address, "stage", days, key_dir=out / "keys")
        for src in [store.dir / "ca.pub", store.dir / "crl.json", *(store.dir / "certs").glob("*.json"),
                    *(store.dir / "trust").glob("*.json")]:
            write_atomic(out / src.relative_to(store.dir), src.read_bytes())
    publish_site(store.dir, config.credentials)  # the running gateway admits the new certificates now


# -- several sites on one host -------------------------------------------------------------------------------
class Network(Protocol):
    """Where the sites of one host run when they are not all on loopback: one network namespace per site
    (the lab's emulated WAN, nebula_lab.wanem.WanLink, is one)."""

    def exec_prefix(self, site: str) -> list[str]:
        """The argv prefix that runs a command inside `site`'s namespace."""

    def address(self, site: str, peer: str | None = None) -> str:
        """`site`'s address on its link to `peer`: where `peer` connects to reach `site`."""


def local_sites(root: Path, names: Sequence[str], stages: Iterable[str] = (), *, run: Path | None = None,
                job: Path | None = None, wan: Network | None = None, gateway: Mapping[str, Any] | None = None,
                channel: Mapping[str, Any] | None = None, data: Sequence[Path] = (),
                days: float = 7) -> dict[str, Path]:
    """Sites `names` under `root`, trusting each other, certified for the stage addresses `stages`; ->
    site -> its config. Layout: keys/<site>/ (every CA store: never for a deployment),
    credentials/<site>/, site-<site>.toml; a site's run directory is root/run-<site> (as on a host of
    its own) or `run` for all (one run directory, as the demo and the benchmarks keep; the gateways'
    audit logs are then audit/<site>.jsonl under it). `job`: [stages] job = that file at every site.

    Ports are picked free now (a tiny race with other programs is accepted). With `wan`, each
    gateway listens on every address of its namespace and reaches a peer at that peer's end of their
    link; otherwise everything is on 127.0.0.1. `gateway` and `channel`: their tables' keys."""
    root = Path(root).resolve()
    ports = {site: (free_port(), free_port()) for site in names}
    configs = {site: _local_config(root, site, names, ports, run, job, wan, gateway, channel, data) for site in names}
    addresses = list(stages)
    for address in addresses:
        if parse_address(address)[0] not in configs:
            raise ConfigError(f"stage {address} is at none of the sites {', '.join(names)}")
    paths = {site: root / f"site-{site}.toml" for site in names}
    stores = [build_site(paths[site], configs[site], [a for a in addresses if parse_address(a)[0] == site], days)
              for site in names]
    trust_each_other(stores, root / "keys")
    for store in stores:
        publish_site(store.dir, configs[store.site].credentials)
    return paths


def _local_config(root: Path, site: str, names: Sequence[str], ports: Mapping[str, tuple[int, int]],
                  run: Path | None, job: Path | None, wan: Network | None, gateway: Mapping[str, Any] | None,
                  channel: Mapping[str, Any] | None, data: Sequence[Path]) -> SiteConfig:
    internal, external = ports[site]
    where = f"local site {site} under {root}"
    table = {"internal": f"tcp://127.0.0.1:{internal}",
             "external": f"tcp://{'0.0.0.0' if wan else '127.0.0.1'}:{external}", **(gateway or {})}
    peers = {other: peer_config(other, {"endpoint": f"tcp://{wan.address(other, site) if wan else '127.0.0.1'}:"
                                                    f"{ports[other][1]}"}, where)
             for other in names if other != site}
    site_run = Path(run).resolve() if run is not None else root / f"run-{site}"
    return SiteConfig(name=site, ca=root / "keys" / site, credentials=root / "credentials" / site, run=site_run,
                      audit=site_run / "audit" / (f"{site}.jsonl" if run is not None else "gateway.jsonl"),
                      data=tuple(Path(d).resolve() for d in data), gateway=gateway_config(site, table, where),
                      peers=peers, channel=build(ChannelConfig, channel or {}, f"{where} [channel]"),
                      stages=StagesConfig(job=Path(job).resolve()) if job is not None else StagesConfig())
