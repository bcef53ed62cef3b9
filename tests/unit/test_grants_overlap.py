"""A data set's owner reads all of its directory without a grant, so no user may register a path that
equals, holds or lies inside another user's data set: that would read their data under a name of
one's own (the reviewer's grant_bypass.py: mallory registered alice's directory as `mycopy`)."""
from __future__ import annotations

import json
import os

import pytest

from nebula.errors import AuthError
from nebula.security.accounts import Accounts
from nebula.security.audit import verify
from nebula.security.grants import DataRegistry
from nebula.site.config import load_site_config
from tests.support.accounts import make_site

SECRET = "correct horse battery"


@pytest.fixture
def site(tmp_path):
    """Site a; alice owns data set `private` (data/alice/private); mallory is another user."""
    config = load_site_config(make_site(tmp_path))
    for user in ("alice", "mallory"):
        Accounts(config.ca).add(user, SECRET)
    (tmp_path / "data" / "alice" / "private" / "part").mkdir(parents=True)
    (tmp_path / "data" / "mallory").mkdir()
    DataRegistry(config.ca).register("private", tmp_path / "data" / "alice" / "private", "alice", config.data)
    return config


def test_another_users_data_set_its_parents_and_children_cannot_be_registered(site, tmp_path):
    registry, data = DataRegistry(site.ca), tmp_path / "data"
    os.symlink(data / "alice" / "private", data / "mallory" / "link")
    before = (site.ca / "datasets.json").read_bytes()
    for path in (data / "alice" / "private", data, data / "alice", data / "alice" / "private" / "part",
                 data / "mallory" / "link"):
        with pytest.raises(AuthError, match=rf"overlaps data set private \({data}/alice/private\) of user alice: "
                                            r".*nebula data grant private --to user:mallory"):
            registry.register("mycopy", path, "mallory", site.data)
    assert (site.ca / "datasets.json").read_bytes() == before
    refused = [r for r in map(json.loads, (site.ca / "audit.jsonl").read_text().splitlines())
               if r["event"] == "data.refused"]
    assert [(r["user"], r["reason"]) for r in refused] == [("mallory", "overlaps data set private")] * 5
    assert verify(site.ca / "audit.jsonl").ok


def test_an_owner_nests_their_own_data_sets_and_others_register_beside_them(site, tmp_path):
    registry, data = DataRegistry(site.ca), tmp_path / "data"
    assert registry.register("part", data / "alice" / "private" / "part", "alice", site.data).owner == "alice"
    assert registry.register("all-of-alice", data / "alice", "alice", site.data).owner == "alice"
    assert registry.register("mine", data / "mallory", "mallory", site.data).owner == "mallory"
    with pytest.raises(AuthError, match="overlaps data set mine .* of user mallory"):
        registry.register("everything", data, "alice", site.data)  # alice's own sets inside are no bar
