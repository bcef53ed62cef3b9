"""Compression phases: which setting LinkCodecs applies at each training step, and the per-step meter."""
import json
import re

import pytest
import torch

from nebula import codecs
from nebula.errors import ConfigError
from nebula.runtime.compression import LinkCodecs

TABLE = {"backward": "int8", "phases": [
    {"steps": 3, "forward": "none", "backward": "none"},
    {"steps": 2, "forward": "fp16"},                       # backward from the default: int8
    {"steps": 1, "forward": "fp16(svd(0.5))", "min_numel": 10},
]}


def test_phases_cover_consecutive_steps_from_one():
    phases = codecs.read_policy(TABLE).phases
    assert [(p.first_step, p.steps) for p in phases] == [(1, 3), (4, 2), (6, None)]  # the last one stays


@pytest.mark.parametrize("step, forward, backward", [
    (0, "none", "none"),                  # before training (e.g. an initial evaluation): first phase
    (1, "none", "none"), (3, "none", "none"),
    (4, "fp16", "int8"), (5, "fp16", "int8"),
    (6, "fp16(svd(0.5))", "int8"),
    (99, "fp16(svd(0.5))", "int8"),       # past the last phase: it stays in force
])
def test_policy_by_step(step, forward, backward):
    phase = LinkCodecs.from_table(TABLE, "a|b").policy.phase_at(step)
    assert (phase.forward.codec, phase.backward.codec) == (codecs.parse(forward), codecs.parse(backward))


def test_phase_keys_are_merged_over_defaults():
    phases = codecs.read_policy(TABLE).phases
    assert phases[2].forward.min_numel == 10 and phases[1].forward.min_numel == 0


def test_without_phases_is_one_open_ended_phase():
    policy = codecs.read_policy({"forward": "fp16", "backward": "int8"})
    assert len(policy.phases) == 1 and policy.phase_at(10_000).forward.codec.spec == "fp16"


def test_the_constructor_takes_the_policy_model():
    fp16 = codecs.Setting(codec=codecs.parse("fp16"))
    link = LinkCodecs(codecs.CompressionPolicy.fixed(forward=fp16), "a|b")
    assert link.pack("forward", "h", torch.randn(8, 16), 7).codec == "fp16"


@pytest.mark.parametrize("table, message", [
    ({"phases": []}, "non-empty list"),
    ({"phases": "fp16"}, "phases: expected a list"),
    ({"phases": [{"forward": "fp16"}]}, "phases[0]: `steps` is required"),
    ({"phases": [{"steps": 0}]}, "phases[0].steps: 0 must be >= 1 (how many training steps this phase lasts)"),
    ({"phases": [{"steps": 2}, {"steps": 1.5}]}, "phases[1].steps"),
    ({"phases": [{"steps": 2, "forward": "nope(1)"}]}, "phases[0]"),
    ({"phases": [{"steps": 2, "colour": "red"}]}, "phases[0]: unknown key 'colour'"),
    ({"forward": "nope", "phases": [{"steps": 2}]}, "compression.forward: codec spec 'nope'"),  # at its own key
    ({"phases": ["fp16"]}, "expected a table"),
])
def test_bad_phases_are_config_errors(table, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        codecs.read_policy(table)


def test_pack_uses_the_step_phase_and_meters_per_step(tmp_path):
    link = LinkCodecs.from_table(TABLE, "a|b", tmp_path / "link.jsonl")
    x = torch.randn(8, 16)
    specs = [link.pack("forward", "hidden", x, step).codec for step in (3, 4, 6)]
    assert specs == ["none", "fp16", codecs.parse("fp16(svd(0.5))").spec]
    ids = link.pack("forward", "ids", torch.arange(8), 4)
    assert ids.codec == "none"  # integers are never compressed
    link.meter.close()
    lines = [json.loads(line) for line in (tmp_path / "link.jsonl").read_text().splitlines()]
    assert [(r["step"], r["codec"], r["raw"]) for r in lines[:3]] == [
        (3, "none", 512), (4, "fp16", 512), (6, codecs.parse("fp16(svd(0.5))").spec, 512)]
    assert lines[1]["wire"] == 256 and all(r["encode_s"] >= 0 for r in lines)


def test_an_evaluation_s_tensors_name_their_split_and_stay_out_of_the_training_ratio(tmp_path):
    """After the last step an evaluation sends its batches under that step's number; with `delta`
    they are all first visits, so counting them in the training ratio overstated it (0.054 for 0.041)."""
    from nebula_lab.bench.wan import per_step_link
    link = LinkCodecs.from_table({"forward": "fp16"}, "a->b", tmp_path / "link.jsonl")
    link.pack("forward", "hidden", torch.randn(8, 16), 2)
    link.pack("forward", "hidden", torch.randn(64, 16), 2, split="valid")
    link.meter.close()
    lines = [json.loads(line) for line in (tmp_path / "link.jsonl").read_text().splitlines()]
    assert ["split" in r for r in lines] == [False, True] and lines[1]["split"] == "valid"
    assert per_step_link(tmp_path / "link.jsonl", "forward")[2]["raw"] == 8 * 16 * 4
