"""One job, one definition (issue 55, point 3: nebula/runtime/job_digest.py) and ports that say what they
take (point 4: nebula/runtime/graph.py check_ports, Port.shape), checked where a job loads. Stages of real
sites with differing job files: tests/e2e/test_integrity.py."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from nebula.errors import ConfigError, StageError
from nebula.runtime.job import parse_job
from nebula.runtime.job_digest import JobDefinition, definition, first_difference
from nebula.runtime.stage import FLOAT, Port

RAW = {"job": {"name": "t"}, "train": {"steps": 12, "batch_size": 16, "micro_batches": 4},
       "stages": {"src": {"address": "a/src/0", "impl": "example-source"},
                  "sink": {"address": "b/sink/0", "impl": "example-sink"}},
       "links": [{"from": "src", "to": "sink", "tensors": ["hidden"], "backward": True,
                  "compression": {"forward": "fp16", "backward": "int8"}}]}


def _job(**changes):
    raw = copy.deepcopy(RAW)
    for path, value in changes.items():
        *keys, last = path.split(".")
        table = raw
        for key in keys:
            table = table[key] if not key.isdigit() else table[int(key)]
        table[last] = value
    return parse_job(raw)


def test_the_same_job_written_differently_has_one_definition():
    plain, explicit = _job(), _job(**{"train.seed": 1, "stages.sink.width": 16, "train.checkpoint_every": 25})
    assert JobDefinition.of(plain) == JobDefinition.of(explicit)  # defaults written out or left out
    keys = list(definition(plain))
    assert keys[:2] == ["job.name", "train.steps"] and "stages.sink.width" in keys
    assert "links.src->sink.compression.phases[0].backward.codec" in keys


def test_what_a_site_may_set_for_itself_is_not_part_of_the_definition():
    base = JobDefinition.of(_job())
    local = _job(**{"stages.sink.device": "cpu", "stages.sink.threads": 2, "train.log_every": 1,
                    "train.tensorboard": True})
    local = dataclasses.replace(local, data="/somewhere/else")
    assert JobDefinition.of(local) == base


@pytest.mark.parametrize("change, key, here, there", [
    ({"train.steps": 14}, "train.steps", "12", "14"),
    ({"stages.sink.lr": 0.02}, "stages.sink.lr", "0.01", "0.02"),
    ({"links.0.compression": {"forward": "fp16", "backward": "int4"}},
     "links.src->sink.compression.phases[0].backward.codec", '"int8"', '"int4"'),
    ({"integrity": {"warn_factor": 4.0}}, "integrity.warn_factor", "10.0", "4.0"),
])
def test_another_definition_is_refused_naming_the_stage_and_the_first_differing_key(change, key, here, there):
    mine, theirs = JobDefinition.of(_job()), JobDefinition.of(_job(**change))
    assert first_difference(mine.keys, theirs.keys) == key
    with pytest.raises(ConfigError, match=f"stage sink \\(b/sink/0\\) runs another definition of this job "
                                          f"\\(first differing key {key.replace('[', '.').replace(']', '.')}: "
                                          f"{here} here, {there} there\\)"):
        mine.check("sink (b/sink/0)", theirs.digest, theirs.keys)
    mine.check("sink (b/sink/0)", mine.digest, mine.keys)  # the same: nothing to say


def test_a_key_only_one_side_has_is_the_difference():
    assert first_difference({"a": "1", "b": "2"}, {"a": "1"}) == "b"
    assert first_difference({"a": "1"}, {"a": "1", "c": "3"}) == "c"


def test_ports_that_declare_their_sizes_must_agree_when_the_job_loads():
    with pytest.raises(ConfigError, match=r"\[\[links\]\] src->sink: 'hidden' is \(B, 16\) at src but sink "
                                          r"takes \(B, 32\); make the stages' options agree"):
        _job(**{"stages.sink.width": 32})


def test_a_required_input_no_link_feeds_is_refused_when_the_job_loads():
    raw = copy.deepcopy(RAW)
    raw["stages"]["mid"] = {"address": "c/mid/0", "impl": "example-middle"}  # needs `hidden`, fed by nothing
    raw["links"].append({"from": "mid", "to": "sink", "tensors": ["hidden"], "backward": True})
    with pytest.raises(ConfigError, match=r"stage mid \(Middle\) needs input 'hidden', but no link feeds it; add "
                                          r"a \[\[links\]\] entry with to = \"mid\""):
        parse_job(raw)
    raw["links"][1]["from"] = "nosuch"
    with pytest.raises(ConfigError, match="no stage 'nosuch'"):  # a link naming what the job lacks, as before
        parse_job(raw)


def test_a_port_shape_is_checked_for_its_rank_and_its_options():
    with pytest.raises(StageError, match=r"shape \(16, 4\) must give the 1 sizes after the batch"):
        Port("hidden", FLOAT, rank=2, shape=(16, 4))
    port = Port("hidden", FLOAT, rank=3, shape=(None, "width"))

    @dataclasses.dataclass
    class Options:
        width: int = 24
    assert port.dims(Options()) == (None, 24)
    with pytest.raises(StageError, match="names option 'depth'"):
        Port("x", FLOAT, rank=2, shape=("depth",)).dims(Options())
