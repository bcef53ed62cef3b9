"""The one site builder (nebula.site.builder) on real key stores, without processes: local sites that trust
each other, an operator's site and its trust in another, a job's own credentials. `site init | trust` as the
operators run them, with the sites brought up: tests/integration/test_site.py."""
from __future__ import annotations

import pytest
import tomllib

from nebula.errors import AuthError, ConfigError
from nebula.security.keyfile import read_json
from nebula.security.keystore import SiteKeyStore
from nebula.site.builder import init_site, job_credentials, local_sites, trust_site
from nebula.site.config import load_site_config


def test_local_sites_trust_each_other_and_each_service_holds_its_own_credentials(tmp_path):
    paths = local_sites(tmp_path, ("a", "b", "c"), ("a/src/0", "b/sink/0"), gateway={"stats_interval": 0},
                        channel={"peer_timeout": 9.0})
    a = load_site_config(paths["a"])
    assert sorted(a.peers) == ["b", "c"] and a.gateway.stats_interval == 0 and a.channel.peer_timeout == 9.0
    assert a.run == tmp_path / "run-a" and a.audit == tmp_path / "run-a" / "audit" / "gateway.jsonl"
    assert load_site_config(paths["b"]).peers["a"].endpoint == a.gateway.external  # on loopback, where a binds
    for site in "abc":
        trusted = {p.stem for p in (tmp_path / "keys" / site / "trust").glob("*.json")}
        assert trusted == set("abc") - {site}
    assert {p.name for p in (tmp_path / "credentials" / "a").iterdir()} == {"a.gateway.0", "a.src.0"}
    assert not list((tmp_path / "credentials").rglob("ca.key"))
    with pytest.raises(ConfigError, match="stage d/x/0 is at none of the sites a, b"):
        local_sites(tmp_path / "other", ("a", "b"), ("d/x/0",))


def test_one_run_directory_for_sites_on_one_host_keeps_each_gateways_audit_apart(tmp_path):
    paths = local_sites(tmp_path, ("a", "b"), run=tmp_path, job=None)
    audits = {load_site_config(path).audit for path in paths.values()}
    assert audits == {tmp_path / "audit" / "a.jsonl", tmp_path / "audit" / "b.jsonl"}
    assert tomllib.loads(paths["a"].read_text())["site"]["run"] == "."  # relative: the directory can move


def test_site_trust_adds_the_peer_through_the_typed_writer_and_refuses_a_wrong_fingerprint(tmp_path):
    line_a = init_site("a", tmp_path / "a", "tcp://127.0.0.1:5600", None, "tcp://127.0.0.1:5601", None, 1)
    line_b = init_site("b", tmp_path / "b", "tcp://127.0.0.1:5700", None, "tcp://127.0.0.1:5701", None, 1)
    with pytest.raises(ConfigError, match="site b was initialised there already"):
        init_site("b", tmp_path / "b", "tcp://127.0.0.1:5700", None, "tcp://127.0.0.1:5701", None, 1)
    config = tmp_path / "b" / "site.toml"
    _, _, _, _, bundle, _, endpoint, _, fingerprint = line_a.split()
    with pytest.raises(AuthError, match="do not trust it"):
        trust_site(config, tmp_path / "a" / bundle, endpoint, "sha256:" + "0" * 32)
    assert trust_site(config, tmp_path / "a" / bundle, endpoint, fingerprint) == "a"
    b = load_site_config(config)
    assert b.peers["a"].endpoint == "tcp://127.0.0.1:5600" and b.gateway.public == "tcp://127.0.0.1:5700"
    assert tomllib.loads(config.read_text())["site"]["ca"] == "keys/b"  # rewritten, still relative
    assert (tmp_path / "b" / "credentials" / "b.gateway.0" / "trust" / "a.json").exists()  # published
    assert line_b.split()[6] == "tcp://127.0.0.1:5700"


def test_a_jobs_credentials_hold_its_own_keys_and_the_sites_public_trust_never_the_ca_key(tmp_path):
    config = load_site_config(local_sites(tmp_path, ("a", "b"), days=1)["a"])
    certs = list(job_credentials(config, tmp_path / "job", ["a/src/0", "a/sink/0"], days=0.5))
    assert [c.address for c in certs] == ["a/src/0", "a/sink/0"]
    held = tmp_path / "job" / "a.src.0"
    assert (held / "keys" / "a.src.0.key").exists() and read_json(held / "ca.pub")
    assert (held / "trust" / "b.json").exists() and not list((tmp_path / "job").rglob("ca.key"))
    assert not (config.ca / "keys" / "a.src.0.key").exists()  # the key never entered the CA store
    assert {c.serial for c in certs} <= {c.serial for c in SiteKeyStore(config.ca).certificates()}


def test_a_fingerprint_read_aloud_is_accepted_in_any_case_without_its_prefix_and_a_new_endpoint_needs_force(
        tmp_path):
    line_a = init_site("a", tmp_path / "a", "tcp://127.0.0.1:5600", None, "tcp://127.0.0.1:5601", None, 1)
    init_site("b", tmp_path / "b", "tcp://127.0.0.1:5700", None, "tcp://127.0.0.1:5701", None, 1,
              data=[tmp_path], metrics_port=9400)
    config = tmp_path / "b" / "site.toml"
    _, _, _, _, bundle, _, endpoint, _, fingerprint = line_a.split()
    spoken = fingerprint.removeprefix("sha256:").upper()
    assert trust_site(config, tmp_path / "a" / bundle, endpoint, spoken) == "a"
    assert trust_site(config, tmp_path / "a" / bundle, endpoint, f"SHA256:{spoken[:16]} {spoken[16:]}") == "a"
    with pytest.raises(ConfigError, match="32 hex digits"):
        trust_site(config, tmp_path / "a" / bundle, endpoint, "9f2c")
    with pytest.raises(ConfigError, match="not 'tcp://10.0.0.9:5600'; if site a moved, .* --force"):
        trust_site(config, tmp_path / "a" / bundle, "tcp://10.0.0.9:5600", fingerprint)
    assert load_site_config(config).peers["a"].endpoint == endpoint  # refused: the operator's value kept
    trust_site(config, tmp_path / "a" / bundle, "tcp://10.0.0.9:5600", fingerprint, force=True)
    b = load_site_config(config)
    assert b.peers["a"].endpoint == "tcp://10.0.0.9:5600"
    assert b.data == (tmp_path.resolve(),) and b.metrics.port == 9400  # site init --data, --metrics-port
    with pytest.raises(ConfigError, match="the bundle file the other site's operator sent you"):
        trust_site(config, tmp_path / "nope.bundle.json", endpoint, fingerprint)
