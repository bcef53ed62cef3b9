"""`nebula site init` and `nebula site trust`: a new site in one command, trust in one line.

init writes, under DIR:  site.toml, keys/<site>/ (the CA store: keep it off service hosts),
credentials/<address>/ (one per service), run/, <site>.bundle.json (what other sites import), and
returns the line another site's operator runs to trust it. The CA fingerprint in that line is what
the two operators compare out of band: `site trust` refuses a bundle whose CA has another one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from nebula.errors import AuthError, ConfigError
from nebula.security.bundle import parse_bundle
from nebula.security.certs import check_site_name
from nebula.security.credentials import publish_site
from nebula.security.keyfile import read_json, write_json
from nebula.security.keys import fingerprint
from nebula.security.keystore import SiteKeyStore
from nebula.site.config import load_site_config, parse_site_config, write_site_config
from nebula.transport.config import check_endpoint


def init_site(name: str, out: Path, public: str, external: str | None, internal: str, job: Path | None,
              days: float, stage_addresses: Sequence[str] = ()) -> str:
    """`stage_addresses`: those of `job`'s stages at this site (its caller loaded the job), certified now."""
    out = Path(out)
    check_site_name(name)
    if (out / "site.toml").exists():
        raise ConfigError(f"{out / 'site.toml'} exists: site {name} was initialised there already; pick another "
                          "--dir, or keep using it")
    port = public.rsplit(":", 1)[-1]
    table: dict = {"site": {"name": name, "ca": f"keys/{name}", "credentials": "credentials", "run": "run",
                            "data": []},
                   "gateway": {"internal": internal, "external": external or f"tcp://0.0.0.0:{port}",
                               "public": public}}
    if job is not None:
        table["stages"] = {"job": str(Path(job).resolve())}
    parse_site_config(table, base=out.resolve(), source=f"{out / 'site.toml'}")  # mistakes before any key exists
    store = SiteKeyStore.init(out / "keys", name)
    store.issue(f"{name}/gateway/0", "gateway", days)
    for address in stage_addresses:
        store.issue(address, "stage", days)
    publish_site(store.dir, out / "credentials")
    write_site_config(out / "site.toml", table)
    bundle = out / f"{name}.bundle.json"
    write_json(bundle, store.export_bundle().to_dict())
    return (f"nebula site trust THEIR_SITE.toml {bundle.name} --endpoint {public} "
            f"--fingerprint {fingerprint(store.ca_public())}")


def trust_site(config: Path, bundle_path: Path, endpoint: str, expected: str, replace: bool) -> str:
    """Import a peer's bundle into this site's CA store (checking the fingerprint the operators
    compared), add its [peers.X] table to the config, refresh the services' credentials."""
    site = load_site_config(config)
    check_endpoint(endpoint, "--endpoint")
    if site.ca is None:
        raise ConfigError(f"{config}: [site].ca is not set; trust is imported into the CA store on the operator's host")
    data = read_json(Path(bundle_path))
    bundle = parse_bundle(data, str(bundle_path))
    if bundle.fingerprint != expected:
        raise AuthError(f"{bundle_path}: CA fingerprint {bundle.fingerprint}, not {expected} as confirmed with "
                        f"site {bundle.site}'s operator; do not trust it (ask them for the right bundle)")
    if bundle.site == site.name:
        raise ConfigError(f"{bundle_path} claims site {site.name}, this site's own name: two sites cannot share "
                          "a name; one of them must `site init` under another")
    SiteKeyStore(site.ca).trust(data, str(bundle_path), replace=replace)
    if bundle.site not in site.peers:
        text = Path(config).read_text()
        peer = f'\n[peers.{bundle.site}]\nendpoint = "{endpoint}"\n'
        Path(config).write_text(text.rstrip("\n") + "\n" + peer)  # appended: the operator's comments stay
    publish_site(site.ca, site.credentials)
    return bundle.site
