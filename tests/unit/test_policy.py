"""CompressionPolicy: start step, overrides, size threshold, and validation messages."""
from __future__ import annotations

import pytest
import torch

from nebula.codecs import CompressionPolicy, Phase, Setting, parse, read_policy
from nebula.errors import ConfigError

TABLE = {
    "forward": "fp16(svd(0.6))",
    "backward": "int8",
    "start_step": 2000,
    "min_numel": 4096,
    "overrides": {"labels": "none", "enc.*.bias": {"backward": "fp16"}, "enc.out": {"forward": "bf16"}},
}


def test_codecs_per_direction_after_the_start_step():
    policy = read_policy(TABLE)
    assert policy.codec_for("forward", "h", 1 << 20, step=2000).spec == "fp16(svd(0.6))"
    assert policy.codec_for("backward", "h", 1 << 20, step=5000).spec == "int8"


def test_uncompressed_before_the_start_step():
    policy = read_policy(TABLE)
    assert policy.codec_for("forward", "h", 1 << 20, step=1999).spec == "none"
    assert policy.codec_for("forward", "labels", 10, step=0).spec == "none"


def test_the_start_step_is_a_phase_of_its_own():
    policy = read_policy(TABLE)
    assert [(p.first_step, p.steps) for p in policy.phases] == [(1, 1999), (2000, None)]
    assert policy.phases[0] == Phase(first_step=1, steps=1999)  # both directions uncompressed
    assert policy.phases[1].forward.codec == parse("fp16(svd(0.6))") and policy.phases[1].forward.min_numel == 4096
    assert read_policy({"forward": "fp16", "start_step": 1}).phases == read_policy({"forward": "fp16"}).phases


def test_a_start_step_inside_phases_holds_back_the_steps_before_it():
    """Each phase's steps before its own start_step (here the default's) go uncompressed, the last
    phase's too though it is open-ended: as when start_step was checked at every send."""
    phases = [{"steps": 3, "forward": "fp16"}, {"steps": 4, "forward": "int8"}]
    policy = read_policy({"start_step": 5, "phases": phases})
    assert [(p.first_step, p.steps) for p in policy.phases] == [(1, 3), (4, 1), (5, None)]
    assert [policy.codec_for("forward", "h", 1, t).spec for t in (1, 4, 5, 99)] == ["none", "none", "int8", "int8"]
    late = read_policy({"phases": [{"steps": 2, "forward": "fp16", "start_step": 10}]})
    assert [late.codec_for("forward", "h", 1, step).spec for step in (2, 9, 10)] == ["none", "none", "fp16"]


def test_overrides_by_name_and_pattern_win_over_size_and_default():
    policy = read_policy(TABLE)
    assert policy.codec_for("backward", "labels", 1 << 20, step=3000).spec == "none"
    assert policy.codec_for("backward", "enc.3.bias", 768, step=3000).spec == "fp16"  # below min_numel
    assert policy.codec_for("forward", "enc.3.bias", 1 << 20, step=3000).spec == "fp16(svd(0.6))"  # other dir
    assert policy.codec_for("forward", "enc.out", 1 << 20, step=3000).spec == "bf16"


def test_an_override_that_leaves_a_direction_out_does_not_hide_a_later_one_for_it():
    """Overrides are per direction: for `abc` going forward the first pattern that names forward wins."""
    policy = read_policy({"overrides": {"ab*": {"backward": "int8"}, "a*": {"forward": "fp16"}}})
    assert policy.codec_for("forward", "abc", 10, 1).spec == "fp16"
    assert policy.codec_for("backward", "abc", 10, 1).spec == "int8"


def test_small_and_integer_tensors_go_uncompressed():
    policy = read_policy(TABLE)
    assert policy.codec_for("forward", "h", 4095, step=3000).spec == "none"
    assert policy.codec_for("forward", "ids", 1 << 20, step=3000, dtype=torch.int64).spec == "none"


def test_defaults_send_everything_raw():
    assert read_policy({}) == CompressionPolicy() == CompressionPolicy.fixed()
    assert read_policy({}).codec_for("forward", "h", 10**6, 10**6).spec == "none"
    assert read_policy({"forward": "fp16"}) == CompressionPolicy.fixed(forward=Setting(codec=parse("fp16")))


@pytest.mark.parametrize("change, words", [
    ({"start_step": -1}, "compression.start_step: -1 must be >= 0 (set 0 to compress from the first step)"),
    ({"start_step": "2000"}, "compression.start_step: expected an integer, got '2000'"),
    ({"min_numel": 1.5}, "compression.min_numel: expected an integer"),
    ({"forward": 5}, "compression.forward: expected a string, got 5"),
    ({"forward": "svd(2)"}, "compression.forward: codec 'svd': ratio=2.0 must be in (0, 1]"),
    ({"backward": "int9"}, "compression.backward: codec spec 'int9'"),
    ({"compres": "fp16"}, "compression: unknown key 'compres'"),
    ({"forwad": "fp16"}, "unknown key 'forwad' (did you mean 'forward'?)"),
    ({"overrides": ["labels"]}, "compression.overrides: expected a table"),
    ({"overrides": {"labels": {"sideways": "none"}}}, "compression.overrides.'labels': unknown key 'sideways'"),
    ({"overrides": {"labels": {}}}, "compression.overrides.'labels': expected a codec spec or a table with forward"),
    ({"overrides": {"labels": {"forward": "topk(0)"}}}, "compression.overrides.'labels'.forward"),
])
def test_invalid_tables_say_which_key_and_how_to_fix_it(change, words):
    with pytest.raises(ConfigError) as info:
        read_policy({**TABLE, **change})
    assert words in str(info.value)


def test_unknown_direction_is_refused():
    with pytest.raises(ConfigError, match="forward"):
        read_policy(TABLE).codec_for("sideways", "h", 1, 1)


def test_phases_that_do_not_follow_each_other_are_refused():
    with pytest.raises(ConfigError, match="follow each other from step 1"):
        CompressionPolicy((Phase(first_step=1, steps=2), Phase(first_step=4, steps=None)))
    with pytest.raises(ConfigError, match="only the last open-ended"):
        CompressionPolicy((Phase(first_step=1, steps=None), Phase(first_step=1, steps=None)))


@pytest.mark.parametrize("table", [{"forward": "delta(int8)", "backward": "delta(int8)"},
                                   {"overrides": {"hidden": {"backward": "delta(fp16)"}}},
                                   {"overrides": {"hidden": "delta(int8)"}}])  # a string names both directions
def test_delta_backward_is_refused_when_the_job_is_read(table):
    """Gradients carry no example ids: delta backward used to fail only at the first send, in the sender thread."""
    with pytest.raises(ConfigError, match=r"= 'delta\(.*gradients carry no example ids"):
        read_policy(table, "links[0].compression")
