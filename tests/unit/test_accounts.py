"""Site accounts: argon2id-hashed secrets in the CA store, audited changes and refusals, `nebula user`."""
from __future__ import annotations

import json
import multiprocessing
import stat

import pytest

from nebula.errors import AuthError, ConfigError
from nebula.security.accounts import Accounts, read_secret
from nebula.security.audit import verify
from tests.support.accounts import cli_runner, make_site, secret_file

SECRET = "correct horse battery"


def events(ca) -> list[dict]:
    return [json.loads(line) for line in (ca / "audit.jsonl").read_text().splitlines()]


@pytest.fixture
def ca(tmp_path):
    make_site(tmp_path)
    return tmp_path / "keys" / "a"


def test_secrets_are_stored_as_argon2id_hashes_in_a_0600_file(ca):
    accounts = Accounts(ca)
    accounts.add("alice", SECRET)
    text = (ca / "users.json").read_text()
    assert "$argon2id$" in text and SECRET not in text
    assert stat.S_IMODE((ca / "users.json").stat().st_mode) == 0o600
    assert accounts.authenticate("alice", SECRET, "test").name == "alice"
    assert [u.name for u in accounts.users()] == ["alice"]
    assert events(ca)[-1]["event"] == "account.added" and events(ca)[-1]["user"] == "alice"


def test_unknown_user_wrong_secret_and_disabled_user_are_refused_and_audited(ca):
    accounts = Accounts(ca)
    accounts.add("alice", SECRET)
    with pytest.raises(AuthError, match="no user 'mallory' at this site"):
        accounts.authenticate("mallory", SECRET, "job.submit")
    with pytest.raises(AuthError, match="wrong secret for user alice"):
        accounts.authenticate("alice", SECRET + "!", "job.submit")
    accounts.set_disabled("alice", True)
    with pytest.raises(AuthError, match="user alice is disabled"):
        accounts.authenticate("alice", SECRET, "job.submit")
    failed = [(e["user"], e["reason"]) for e in events(ca) if e["event"] == "account.auth_failed"]
    assert failed == [("mallory", "unknown user"), ("alice", "wrong secret"), ("alice", "disabled")]
    accounts.set_disabled("alice", False)
    assert accounts.authenticate("alice", SECRET, "job.submit").name == "alice"
    assert verify(ca / "audit.jsonl").ok


def test_bad_names_weak_secrets_duplicates_and_unknown_users_are_config_errors(ca):
    accounts = Accounts(ca)
    with pytest.raises(ConfigError, match="user name 'Alice!'"):
        accounts.add("Alice!", SECRET)
    with pytest.raises(ConfigError, match="at least 8"):
        accounts.add("bob", "short")
    accounts.add("bob", SECRET)
    with pytest.raises(ConfigError, match="user bob already exists"):
        accounts.add("bob", SECRET)
    with pytest.raises(ConfigError, match="no user 'carol'.*have: bob"):
        accounts.remove("carol")
    accounts.remove("bob")
    assert accounts.users() == [] and events(ca)[-1]["event"] == "account.removed"


def _add_users(ca, prefix):
    for i in range(2):
        Accounts(ca).add(f"{prefix}{i}", SECRET)


def test_concurrent_changes_from_several_processes_all_land(ca):
    procs = [multiprocessing.get_context("fork").Process(target=_add_users, args=(ca, f"u{p}x")) for p in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(Accounts(ca).users()) == 8
    assert verify(ca / "audit.jsonl").ok


def test_secret_file_must_be_private_and_a_missing_secret_says_where_to_give_it(tmp_path, monkeypatch):
    path = secret_file(tmp_path / "s", SECRET)
    assert read_secret(path) == SECRET
    path.chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        read_secret(path)
    monkeypatch.setenv("NEBULA_SECRET", SECRET)
    assert read_secret(None) == SECRET
    monkeypatch.delenv("NEBULA_SECRET")
    with pytest.raises(ConfigError, match="--secret-file FILE"):
        read_secret(None)  # pytest's stdin is not a terminal: no prompt


@pytest.fixture
def nebula(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ["user", "audit"])


def test_user_commands_end_to_end(nebula, tmp_path, monkeypatch):
    config = str(make_site(tmp_path))
    secret = str(secret_file(tmp_path / "alice.secret", SECRET))
    assert nebula("user", "add", "alice", "--site-config", config, "--secret-file", secret)[1] == "added user alice\n"
    monkeypatch.setenv("NEBULA_SECRET", "another secret")
    assert nebula("user", "add", "bob", "--site-config", config)[0] == 0
    assert nebula("user", "disable", "bob", "--site-config", config)[0] == 0
    code, out, _ = nebula("user", "list", "--site-config", config)
    assert code == 0 and [line.split()[:2] for line in out.splitlines()] == [
        ["USER", "STATE"], ["alice", "enabled"], ["bob", "disabled"]]
    code, _, err = nebula("user", "add", "alice", "--site-config", config)
    assert code == 2 and "user alice already exists" in err
    assert nebula("user", "remove", "bob", "--site-config", config)[0] == 0
    code, _, err = nebula("user", "disable", "bob", "--site-config", config)
    assert code == 2 and "no user 'bob'" in err
    code, out, _ = nebula("audit", "verify", str(tmp_path / "keys" / "a" / "audit.jsonl"))
    assert code == 0 and "ok: 6 records" in out  # ca_created, the gateway issued, 2 added, disabled, removed


def test_a_site_config_without_a_ca_store_says_where_users_live(nebula, tmp_path):
    config = make_site(tmp_path)
    config.write_text(config.read_text().replace('ca = "keys/a"\n', ""))
    code, _, err = nebula("user", "list", "--site-config", str(config))
    assert code == 2 and "names no [site].ca" in err


def test_a_secret_hash_holds_the_parameters_docs_security_states():
    """docs/security.md, "Accounts": argon2id, 2 passes over 64 MiB, 8 characters or more."""
    from pathlib import Path

    from nebula.security.accounts import hash_secret

    params = hash_secret("correct horse").split("$")[3]  # $argon2id$v=19$m=65536,t=2,p=1$salt$hash
    assert params == "m=65536,t=2,p=1"
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text().split())
    assert "2 passes over 64 MiB per check" in doc and "A secret (8 characters or more)" in doc
    with pytest.raises(ConfigError, match="at least 8"):
        hash_secret("7 chars")
