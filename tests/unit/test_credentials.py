"""A service's credential directory: its own key and the public trust material, never the CA's secret."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.security.credentials import EXPIRED_KEPT_S, bundle_service, publish_site, refuse_ca_key
from nebula.security.keystore import DAY, SiteKeyStore
from nebula.security.trust import TrustStore, load_identity

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path) -> SiteKeyStore:
    a = SiteKeyStore.init(tmp_path / "keys", "a")
    a.issue("a/gateway/0", "gateway", days=1)
    a.issue("a/encoder/0", "stage", days=1)
    return a


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_bundle_holds_its_own_key_and_public_files_only(store, tmp_path):
    out = tmp_path / "svc" / "a.encoder.0"
    bundle_service(store.dir, "a/encoder/0", out)
    got = files(out)
    assert {"ca.pub", "crl.json", "keys/a.encoder.0.key"} <= got
    assert not any(name.endswith("ca.key") or name == "keys/a.gateway.0.key" for name in got)
    assert sum(name.startswith("certs/") for name in got) == 2  # every certificate: peers are checked with them
    identity = load_identity(out, "a/encoder/0")
    assert identity.certificate.address == "a/encoder/0" and TrustStore.load(out).cas


def test_a_refresh_rewrites_only_what_changed_and_drops_what_is_gone(store, tmp_path):
    out = tmp_path / "svc" / "a.encoder.0"
    bundle_service(store.dir, "a/encoder/0", out)
    assert bundle_service(store.dir, "a/encoder/0", out) == []  # nothing new: the trust store need not reload
    serial = next(c.serial for c in store.certificates() if c.address == "a/gateway/0")
    store.revoke(serial)
    assert bundle_service(store.dir, "a/encoder/0", out) == ["crl.json"]
    gone = next((store.dir / "certs").glob("a.gateway.0.*.json"))
    gone.unlink()
    assert bundle_service(store.dir, "a/encoder/0", out) == [f"certs/{gone.name} (removed)"]


def test_certificates_long_expired_are_no_longer_shipped(store, tmp_path):
    old = store.issue("a/old/0", "stage", days=1, now=time.time() - EXPIRED_KEPT_S - 2 * DAY)
    recent = store.issue("a/recent/0", "stage", days=1, now=time.time() - 2 * DAY)  # expired, kept a while
    changed = publish_site(store.dir, tmp_path / "svc")
    assert set(changed) == {"a/gateway/0", "a/encoder/0", "a/old/0", "a/recent/0"}
    names = files(tmp_path / "svc" / "a.encoder.0")
    assert f"certs/a.recent.0.{recent.serial:016x}.json" in names
    assert f"certs/a.old.0.{old.serial:016x}.json" not in names


def test_a_service_refuses_a_ca_key_it_can_read(store, tmp_path):
    with pytest.raises(ConfigError, match="ca.key is readable by this service.*bundle-service"):
        load_identity(store.dir, "a/encoder/0")  # the CA store itself
    out = tmp_path / "svc" / "a.encoder.0"
    bundle_service(store.dir, "a/encoder/0", out)
    (out.parent / "ca.key").write_bytes((store.dir / "ca.key").read_bytes())  # one directory up
    with pytest.raises(ConfigError, match="never the CA's secret"):
        refuse_ca_key(out)


def test_bad_requests_are_clear(store, tmp_path):
    with pytest.raises(ConfigError, match="holds no key for a/decoder/0; issue it first"):
        bundle_service(store.dir, "a/decoder/0", tmp_path / "x")
    with pytest.raises(ConfigError, match="lies inside the CA store"):
        bundle_service(store.dir, "a/encoder/0", store.dir / "services" / "a.encoder.0")


def test_the_command_writes_a_bundle(store, tmp_path):
    out = tmp_path / "svc"
    done = subprocess.run([sys.executable, "-m", "nebula.cli", "keys", "bundle-service", "a/gateway/0",
                           "--dir", str(store.dir.parent), "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no ca.key" in done.stdout and json.loads((out / "ca.pub").read_text())["site"] == "a"


def test_a_job_publishes_its_certificates_while_site_up_refreshes_them(store, tmp_path):
    """`job submit` issues and publishes while `site up` refreshes every service's directory in another
    process: each new certificate is in place when publish returns and no publish fails (unlocked, a
    refresh swept away the other's new certificate or its temporary file: FileNotFoundError)."""
    out, stop = tmp_path / "svc", tmp_path / "stop"
    refresher = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib\n"
        "from nebula.security.credentials import publish_site\n"
        "stop = pathlib.Path(sys.argv[3])\n"
        "while not stop.exists(): publish_site(sys.argv[1], sys.argv[2])\n"), str(store.dir), str(out), str(stop)],
        cwd=REPO)
    try:
        for i in range(20):
            cert = store.issue(f"a/job{i}/0", "stage", days=1)
            publish_site(store.dir, out)
            name = f"certs/a.job{i}.0.{cert.serial:016x}.json"
            assert name in files(out / "a.encoder.0"), f"job {i}'s certificate is missing right after publishing"
    finally:
        stop.touch()
        assert refresher.wait(30) == 0
