"""Data sets and read grants: registration under the data roots, grants to users and jobs, every
grant, refusal and read audited; a stage's [job].data = "dataset:NAME" opens data only through them."""
from __future__ import annotations

import json
import os

import pytest

from nebula import cli
from nebula.errors import AuthError, ConfigError, DataError
from nebula.runtime.job import parse_job
from nebula.runtime.service import build_stage
from nebula.security.accounts import Accounts, RecordFile
from nebula.security.audit import verify
from nebula.security.grants import DataAccess, DataRegistry, Principal, open_dataset
from nebula.security.job_record import RECORD_FORMAT, job_dir
from nebula.site.config import load_site_config
from tests.support.accounts import cli_runner, make_site, secret_file

SECRET = "correct horse battery"


def events(ca, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (ca / "audit.jsonl").read_text().splitlines()) if r["event"] == kind]


@pytest.fixture
def site(tmp_path):
    """Site a with users alice (owner of data set `corpus`) and bob, and jobs of theirs."""
    config = load_site_config(make_site(tmp_path))
    for user in ("alice", "bob"):
        Accounts(config.ca).add(user, SECRET)
    (tmp_path / "data" / "corpus").mkdir()
    (tmp_path / "data" / "corpus" / "train.txt").write_text("hola\n")
    DataRegistry(config.ca).register("corpus", tmp_path / "data" / "corpus", "alice", config.data)
    for job, owner in (("j-alice", "alice"), ("j-bob", "bob"), ("j-bob2", "bob")):
        job_dir(config.run, job).mkdir(parents=True)
        with RecordFile(job_dir(config.run, job) / "job.json", RECORD_FORMAT, "job").update() as record:
            record.update(id=job, owner=owner)
    return config


def test_the_owner_and_their_jobs_read_others_only_with_a_grant(site):
    alice_job, bob_job = Principal("alice", "j-alice"), Principal("bob", "j-bob")
    assert open_dataset(site, "corpus", alice_job) == site.data[0] / "corpus"
    with pytest.raises(AuthError, match=r"job:j-bob \(user bob\) holds no grant on data set corpus; .*"
                                        r"nebula data grant corpus --to user:bob"):
        open_dataset(site, "corpus", bob_job)
    registry = DataRegistry(site.ca)
    registry.grant("corpus", "job:j-bob", by="alice")
    assert open_dataset(site, "corpus", bob_job).name == "corpus"
    with pytest.raises(AuthError, match="holds no grant"):
        open_dataset(site, "corpus", Principal("bob", "j-bob2"))  # another job of bob's: not this grant
    registry.revoke("corpus", "job:j-bob", by="alice")
    registry.grant("corpus", "user:bob", by="alice")
    assert open_dataset(site, "corpus", bob_job).name == "corpus"
    reads = [(r["user"], r["job"]) for r in events(site.ca, "data.read")]
    assert reads == [("alice", "j-alice"), ("bob", "j-bob"), ("bob", "j-bob")]
    assert [(r["user"], r["reason"]) for r in events(site.ca, "data.refused")] == [
        ("bob", "no grant"), ("bob", "no grant")]
    assert [r["grantee"] for r in events(site.ca, "data.granted")] == ["job:j-bob", "user:bob"]
    assert verify(site.ca / "audit.jsonl").ok


def test_a_job_cannot_read_as_another_users_job_and_a_disabled_user_reads_nothing(site):
    DataRegistry(site.ca).grant("corpus", "user:bob", by="alice")
    with pytest.raises(AuthError, match="job j-alice is a job of alice, not of bob"):
        open_dataset(site, "corpus", Principal("bob", "j-alice"))
    with pytest.raises(AuthError, match="job j-none is not a job of this site"):
        open_dataset(site, "corpus", Principal("bob", "j-none"))
    Accounts(site.ca).set_disabled("bob", True)
    with pytest.raises(AuthError, match="user bob is disabled"):
        open_dataset(site, "corpus", Principal("bob", "j-bob"))
    with pytest.raises(AuthError, match="no data set 'other' at this site"):
        open_dataset(site, "other", Principal("alice", "j-alice"))
    assert [r["reason"] for r in events(site.ca, "data.refused")] == [
        "job not of this user", "job not of this user", "account missing or disabled", "unknown data set"]


def test_only_the_owner_grants_and_bad_grants_are_clear_errors(site):
    registry = DataRegistry(site.ca)
    with pytest.raises(AuthError, match="belongs to alice, not bob: only its owner grants"):
        registry.grant("corpus", "user:bob", by="bob")
    with pytest.raises(ConfigError, match="no data set 'nope'"):
        registry.grant("nope", "user:bob", by="alice")
    with pytest.raises(ConfigError, match="no user carol"):
        registry.grant("corpus", "user:carol", by="alice")
    with pytest.raises(ConfigError, match="user:NAME or a job as job:ID"):
        registry.grant("corpus", "group:x", by="alice")
    with pytest.raises(ConfigError, match="user:bob holds no grant"):
        registry.revoke("corpus", "user:bob", by="alice")
    assert events(site.ca, "data.refused")[-1]["reason"] == "not the owner"


def test_data_sets_must_be_directories_inside_the_data_roots(site, tmp_path):
    registry = DataRegistry(site.ca)
    (tmp_path / "outside").mkdir()
    with pytest.raises(ConfigError, match="outside the site's data roots"):
        registry.register("x", tmp_path / "outside", "alice", site.data)
    os.symlink(tmp_path / "outside", tmp_path / "data" / "link")
    with pytest.raises(ConfigError, match="outside the site's data roots"):  # a symlink does not smuggle it in
        registry.register("x", tmp_path / "data" / "link", "alice", site.data)
    with pytest.raises(DataError, match="not a directory"):
        registry.register("x", tmp_path / "data" / "corpus" / "train.txt", "alice", site.data)
    with pytest.raises(ConfigError, match="names no data roots"):
        registry.register("x", tmp_path / "data" / "corpus", "alice", ())
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("corpus", tmp_path / "data" / "corpus", "alice", site.data)
    with pytest.raises(ConfigError, match="--owner carol: no such user"):
        registry.register("y", tmp_path / "data" / "corpus", "carol", site.data)
    with pytest.raises(AuthError, match="outside the site's data roots"):  # a root dropped from the config later
        open_dataset(site.__class__(**{**site.__dict__, "data": (tmp_path / "outside",)}), "corpus",
                     Principal("alice", "j-alice"))


def test_data_access_opens_paths_outside_jobs_and_only_grants_inside_them(site, monkeypatch, tmp_path):
    monkeypatch.setenv("NEBULA_JOB_ID", "j-alice")  # the environment is no principal: only what the entry point passes
    monkeypatch.setenv("NEBULA_USER", "alice")
    assert DataAccess().open(str(tmp_path)) == tmp_path  # tests and the demo: a directory, as before
    assert DataAccess(site).open(None) is None
    with pytest.raises(AuthError, match="started without --job-id"):
        DataAccess(site).open("dataset:corpus")
    with pytest.raises(ConfigError, match="nebula stage run --site CONFIG"):
        DataAccess(None, Principal("alice", "j-alice")).open("dataset:corpus")
    bob = DataAccess(site, Principal("bob", "j-bob"))
    with pytest.raises(AuthError, match="a submitted job reads data only through a grant"):
        bob.open(str(tmp_path))
    with pytest.raises(AuthError, match="holds no grant"):
        bob.open("dataset:corpus")
    with pytest.raises(AuthError, match="job j-bob is a job of bob, not of alice"):
        DataAccess(site, Principal("alice", "j-bob")).open("dataset:corpus")  # a claim the job's record refutes
    assert DataAccess(site, Principal("alice", "j-alice")).open("dataset:corpus") == site.data[0] / "corpus"
    assert [r["reason"] for r in events(site.ca, "data.refused")] == ["no grant", "job not of this user"]


def test_a_principal_is_a_job_and_its_owner_as_the_entry_point_was_told():
    assert Principal.of_job(None, "bob") is None  # --user alone (NEBULA_USER, every command's default): no job
    assert Principal.of_job("j-bob", "bob") == Principal("bob", "j-bob")
    with pytest.raises(AuthError, match="job id 'j-bob' without a user"):
        Principal.of_job("j-bob", None)
    with pytest.raises(ConfigError, match="is not a job id"):
        Principal.of_job("../j", "bob")


def test_a_stage_context_opens_its_dataset_once_through_the_grants(site, tmp_path):
    job = parse_job({"job": {"name": "t", "data": "dataset:corpus"},
                     "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                                "sink": {"address": "a/sink/0", "impl": "example-sink"}},
                     "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True}]},
                    source=tmp_path / "job.toml")
    assert job.data == "dataset:corpus"  # not taken for a path relative to the job file
    stage = build_stage(job, "src", tmp_path / "src", quiet=True,
                        access=DataAccess(site, Principal("alice", "j-alice")))
    assert stage.context.access == DataAccess(site, Principal("alice", "j-alice"))
    assert stage.context.data == stage.context.data == site.data[0] / "corpus"
    assert len(events(site.ca, "data.read")) == 1


@pytest.fixture
def nebula(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ["user", "data"])


def test_data_commands_end_to_end(nebula, tmp_path):
    config = str(make_site(tmp_path))
    alice, bob = secret_file(tmp_path / "alice", SECRET), secret_file(tmp_path / "bob", SECRET + "2")
    for user, secret in (("alice", alice), ("bob", bob)):
        assert nebula("user", "add", user, "--site-config", config, "--secret-file", str(secret))[0] == 0
    (tmp_path / "data" / "es-en").mkdir()
    args = ("--site-config", config, "--secret-file")
    code, out, _ = nebula("data", "register", "es-en", str(tmp_path / "data" / "es-en"), "--owner", "alice",
                          *args, str(alice))
    assert code == 0 and out.startswith("registered data set es-en")
    code, _, err = nebula("data", "grant", "es-en", "--to", "user:bob", *args, str(bob))  # bob is not the owner
    assert code == 2 and "wrong secret for user alice" in err
    assert nebula("data", "grant", "es-en", "--to", "user:bob", *args, str(alice))[0] == 0
    code, _, err = nebula("data", "grant", "es-en", "--to", "job:20990101-abcdef", *args, str(alice))
    assert code == 2 and "no job 20990101-abcdef at site a" in err
    code, out, _ = nebula("data", "list", "--site-config", config)
    assert code == 0 and out.splitlines()[1].split() == ["es-en", "alice", str(tmp_path / "data" / "es-en"),
                                                          "user:bob"]
    code, _, err = nebula("user", "remove", "alice", "--site-config", config)
    assert code == 2 and "owns the data sets es-en" in err
    code, out, _ = nebula("user", "remove", "bob", "--site-config", config)
    assert code == 0 and "revoked their grants on es-en" in out
    assert nebula("data", "list", "--site-config", config)[1].splitlines()[1].split()[-1] == "-"


def test_a_workloads_data_action_sits_beside_the_frameworks(nebula, capsys):
    """`nebula data` is the framework's; the corpus workload's spec adds `prepare` to it."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["data", "prepare", "--help"])
    assert exit_.value.code == 0 and "--pairs" in capsys.readouterr().out
