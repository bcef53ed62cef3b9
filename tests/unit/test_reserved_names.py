"""Stage names that denote a role (issue 12, finding 4): refused when issued, and refused at admission
even in a certificate signed before the names were reserved."""
from __future__ import annotations

import pytest

from nebula import cli
from nebula.errors import AuthError, ConfigError
from nebula.runtime.job import parse_job
from nebula.security.certs import RESERVED_NAMES, address_filename, role_name
from nebula.security.keystore import SiteKeyStore
from nebula.security.trust import TrustStore, check_peer
from tests.support.certs import legacy_certificate


@pytest.fixture
def store(tmp_path) -> SiteKeyStore:
    return SiteKeyStore.init(tmp_path, "a")


@pytest.mark.parametrize("address, role", [
    ("a/gateway/7", "stage"), ("a/Gateway/7", "stage"), ("a/GATEWAY/0", "stage"), ("a/admin/1", "stage"),
    ("a/ca/0", "stage"), ("a/admin/0", "gateway"), ("a/gateway/1", "admin"), ("a/ca/0", "gateway"),
])
def test_issue_refuses_a_name_that_denotes_another_role(store, address, role):
    with pytest.raises(ConfigError, match=r"reserved.*gateway, admin, ca"):
        store.issue(address, role, days=1)
    name = address_filename(address)
    assert not list((store.dir / "certs").glob(f"{name}.*")) and not (store.dir / "keys" / f"{name}.key").exists()


@pytest.mark.parametrize("address, role", [
    ("a/gateway/0", "gateway"), ("a/gateway/1", "gateway"), ("a/admin/0", "admin"),
    ("a/gateway-proxy/0", "stage"), ("a/gw/7", "stage"), ("a/encoder/0", "stage"),
])
def test_issue_accepts_role_names_in_their_own_role_and_every_other_name(store, address, role):
    assert store.issue(address, role, days=1).address == address


def test_the_keys_command_refuses_with_the_reason(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "COMMANDS", ["keys"])
    code = cli.main(["keys", "issue", "a/gateway/7", "--role", "stage", "--days", "1", "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "a/gateway/7" in err and "reserved" in err


def test_admission_refuses_a_role_named_stage_certificate_issued_before_the_rule(store):
    store.issue("a/gateway/0", "gateway", days=1)
    forged = legacy_certificate(store, "a/gateway/7")
    trust = TrustStore.load(store.dir)
    with pytest.raises(AuthError, match=r"^reserved name: a/gateway/7"):
        check_peer(trust, forged.curve_key_raw, {"stage"}, sites={"a"})
    gateway = next(c for c in store.certificates() if c.address == "a/gateway/0")
    assert check_peer(trust, gateway.curve_key_raw, {"gateway"}).address == "a/gateway/0"


def test_a_job_file_naming_a_stage_like_a_role_is_refused_on_load(tmp_path):
    raw = {"job": {"name": "t", "data": "d"}, "train": {"steps": 1, "batch_size": 4},
           "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                      "sink": {"address": "b/Gateway/0", "impl": "example-sink"}},
           "links": [{"from": "src", "to": "sink", "tensors": ["features"]}]}
    with pytest.raises(ConfigError, match=r"job.toml: \[stages.sink\].address: b/Gateway/0: .*reserved"):
        parse_job(raw, source=tmp_path / "job.toml")


def test_role_name_reads_the_stage_part_of_an_address():
    assert set(RESERVED_NAMES) == {"gateway", "admin", "ca"}
    assert role_name("b/gateway/0") == "gateway" and role_name("b/Admin/3") == "admin"
    assert role_name("b/dec/0") is None and role_name("b/gateway-1/0") is None and role_name("garbage") is None
