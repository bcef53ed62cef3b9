"""Job files parse into typed config, and every mistake is a ConfigError that says what to fix."""
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.runtime.job import load_job, parse_job
from nebula.runtime.registry import registered_stages, resolve_stage

ROOT = Path(__file__).resolve().parents[2]


def job(**overrides):
    raw = {"job": {"name": "t", "data": "d"},
           "stages": {"encoder": {"address": "a/encoder/0", "impl": "abnet-encoder", "max_train_examples": 10}},
           "train": {"steps": 4, "batch_size": 8, "micro_batches": 2}}
    raw.update(overrides)
    return raw


def test_shipped_job_files_load_and_their_stages_resolve():
    for path in (ROOT / "deploy" / "jobs").glob("*.toml"):
        config = load_job(path)
        assert config.stage("encoder").site == "a" and config.stage("decoder").site == "b"
        assert Path(config.data).is_absolute()  # relative to the job file
        for stage in config.stages.values():
            assert resolve_stage(stage.impl).stage_name == stage.impl
    assert {"abnet-encoder", "abnet-decoder"} <= set(registered_stages())


def test_stage_options_are_kept_for_the_implementation():
    assert parse_job(job()).stage("encoder").options == {"max_train_examples": 10}


@pytest.mark.parametrize("change, message", [
    ({"train": {"steps": 0}}, "steps: must be a positive integer"),
    ({"train": {"batch_size": 9, "micro_batches": 2}}, "multiple of micro_batches"),
    ({"train": {"stepz": 3}}, "unknown key"),
    ({"train": {"staleness": 2}}, "staleness: must be 0"),
    ({"stages": {"encoder": {"address": "a/encoder", "impl": "x"}}}, "not site/stage/rank"),
    ({"stages": {}}, "at least one"),
    ({"compression": {"forward": "fp16(svd(2))"}}, "compression.forward"),
    ({"extra": {}}, "unknown section"),
])
def test_mistakes_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(job(**change))


def test_unknown_stage_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="abnet-encoder"):
        resolve_stage("no-such-stage")
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_stage("no.such.module:Stage")


def test_missing_job_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "nope.toml")


def test_language_pair_jobs_differ_only_in_their_data():
    """abnet-es-en and abnet-zh-en run the same schedule and decoding (they drifted apart once)."""
    es, zh = (load_job(ROOT / "deploy" / "jobs" / f"abnet-{pair}.toml") for pair in ("es-en", "zh-en"))
    assert es.train == zh.train and es.compression == zh.compression
    assert {n: s.options for n, s in es.stages.items()} == {n: s.options for n, s in zh.stages.items()}
    assert Path(es.data).name == "es-en" and Path(zh.data).name == "zh-en"
