"""The shipped site configs load; every mistake in one names the file and the key and says how to fix it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomli_w
import tomllib

from nebula.errors import ConfigError
from nebula.site.config import MetricsConfig, StagesConfig, load_site_config, write_site_config
from nebula.site.site import site_services

REPO = Path(__file__).resolve().parents[2]
SITES = REPO / "deploy" / "sites"


@pytest.mark.parametrize("name", ["a", "b", "template"])
def test_the_shipped_site_configs_load(name):
    site = load_site_config(SITES / f"{name}.toml")
    assert site.ca is not None and site.credentials.is_absolute() and site.gateway.public
    assert site.audit.is_relative_to(site.run) and site.metrics.port == 0


def test_site_a_runs_its_gateway_and_the_encoder_with_metrics_ports_when_asked(tmp_path):
    site = load_site_config(SITES / "a.toml")
    path = tmp_path / "a.toml"
    write_site_config(path, dataclasses.replace(
        site, metrics=MetricsConfig(port=9400), stages=StagesConfig(job=SITES.parent / "jobs" / "abnet-es-en.toml")))
    services = site_services(load_site_config(path), path)
    assert [(s.name, s.env["NEBULA_ADDRESS"], s.env["NEBULA_METRICS_PORT"]) for s in services] == [
        ("gateway", "a/gateway/0", "9400"), ("encoder", "a/encoder/0", "9401")]
    assert all(s.environment({})["NEBULA_STATUS_FILE"] == str(site.run / "status" / f"{s.name}.json")
               and s.restart for s in services)


def test_the_writer_writes_what_the_loader_reads_back_paths_relative_to_the_file(tmp_path):
    """One writer of site configs (nebula.site.config.write_site_config): every table of the shipped
    site a, through the typed config and back, unchanged; paths under the file's directory relative."""
    site = load_site_config(SITES / "a.toml")
    moved = dataclasses.replace(site, credentials=tmp_path / "credentials", run=tmp_path / "run",
                                audit=tmp_path / "run" / "audit" / "gateway.jsonl",
                                channel=dataclasses.replace(site.channel, window_messages=3))
    written = write_site_config(tmp_path / "site.toml", moved)
    assert dataclasses.replace(written, source=site.source) == moved
    table = tomllib.loads((tmp_path / "site.toml").read_text())
    assert (table["site"]["credentials"], table["site"]["run"]) == ("credentials", "run")
    assert "audit" not in table["site"] and table["channel"] == {"window_messages": 3}  # defaults left out
    with pytest.raises(ConfigError, match=r"\[gateway\].io_threads: 0 must be >= 1"):
        write_site_config(tmp_path / "bad.toml", dataclasses.replace(
            site, gateway=dataclasses.replace(site.gateway, io_threads=0)))
    assert not (tmp_path / "bad.toml").exists()


def _mistake(tmp_path, edit) -> str:
    table = tomllib.loads((SITES / "a.toml").read_text())
    table["stages"]["job"] = str(SITES.parent / "jobs" / "abnet-es-en.toml")
    edit(table)
    path = tmp_path / "a.toml"
    path.write_text(tomli_w.dumps(table))
    with pytest.raises(ConfigError) as info:
        site_services(load_site_config(path), path)
    return str(info.value)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["site"].update(keys="keys/a"), "[site].keys: `keys` (a whole key store) is gone"),
    (lambda t: t["site"].pop("credentials"), "[site]: `credentials` is required"),
    (lambda t: t["site"].update(name="a/b"), "[site].name: site name 'a/b' must be letters"),
    (lambda t: t["site"].update(data="data"), "[site].data: expected a list"),
    (lambda t: t["gateway"].update(external="0.0.0.0:5600"), "[gateway].external: '0.0.0.0:5600' is not a ZeroMQ"),
    (lambda t: t["gateway"].update(io_threads=0), "[gateway].io_threads: 0 must be >= 1"),
    (lambda t: t["peers"].update(a={"endpoint": "tcp://x:1"}), "[peers.a] names this site itself"),
    (lambda t: t["peers"]["b"].update(endpont="tcp://x:1"),
     "[peers.b]: unknown key 'endpont' (did you mean 'endpoint'?)"),
    (lambda t: t["metrics"].update(port=70000), "[metrics].port: 70000 must be >= 0 and <= 65535"),
    (lambda t: t.update(stage={"job": "x"}), "unknown table [stage]"),
    (lambda t: t["stages"].update(run=["decoder"]), "stage decoder runs at site b (b/decoder/0), not at a"),
    (lambda t: t["stages"].update(run=["encodr"]), "'encodr' is not a stage of"),
    (lambda t: t["stages"].pop("job"), "[stages]: `run` names stages but no `job` says whose"),
])
def test_every_mistake_names_the_file_and_the_key(tmp_path, edit, message):
    got = _mistake(tmp_path, edit)
    assert str(tmp_path / "a.toml") in got and message in got
