"""Throw-away sites for benchmarks and tests: key stores that trust each other, and site configs.

    paths = make_sites(tmp, {"a": ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7000"),
                             "b": ("tcp://127.0.0.1:7101", "tcp://127.0.0.1:7100")},
                       stages=["a/enc/0", "b/dec/0"])
    # paths["a"] is a.toml; start its gateway with `nebula gateway run --site-config a.toml`

Certificates last one day. Never use this for a real deployment: it keeps every site's CA in one place.
"""
from __future__ import annotations

from pathlib import Path

from nebula.security.credentials import publish_site
from nebula.security.keystore import SiteKeyStore


def make_sites(root: Path, endpoints: dict[str, tuple[str, str]], stages: list[str],
               peer_endpoints: dict[str, str] | None = None, extra_gateway: str = "") -> dict[str, Path]:
    """`endpoints`: site -> (internal bind, external bind). `peer_endpoints`: site -> what the others
    connect to (default: its external bind). Returns site -> config path."""
    root = Path(root)
    stores = {site: SiteKeyStore.init(root / "keys", site) for site in endpoints}
    for site, store in stores.items():
        store.issue(f"{site}/gateway/0", "gateway", days=1)
    for stage in stages:
        stores[stage.split("/", 1)[0]].issue(stage, "stage", days=1)
    for site, store in stores.items():
        for other, other_store in stores.items():
            if other != site:
                store.trust(other_store.export_bundle().to_dict(), f"{other}.json")
    reach = {site: (peer_endpoints or {}).get(site, external) for site, (_, external) in endpoints.items()}
    publish(root, list(endpoints))
    paths = {}
    for site, (internal, external) in endpoints.items():
        peers = "".join(f'[peers.{o}]\nendpoint = "{reach[o]}"\n' for o in endpoints if o != site)
        text = (f'[site]\nname = "{site}"\nca = "keys/{site}"\ncredentials = "credentials/{site}"\n'
                f'run = "run-{site}"\naudit = "audit-{site}.jsonl"\n\n'
                f'[gateway]\ninternal = "{internal}"\nexternal = "{external}"\n{extra_gateway}\n{peers}')
        paths[site] = root / f"{site}.toml"
        paths[site].write_text(text)
    return paths


def publish(root: Path, sites: list[str]) -> None:
    """Refresh every service's credential directory (root/credentials/<site>/<address>) from the CA
    stores: after issuing or revoking, as `nebula site up` does on its own."""
    for site in sites:
        publish_site(Path(root) / "keys" / site, Path(root) / "credentials" / site)
