"""CompressionPolicy: start step, overrides, size threshold, and validation messages."""
from __future__ import annotations

import pytest
import torch

from nebula.codecs import CompressionPolicy, parse
from nebula.errors import ConfigError

TABLE = {
    "forward": "fp16(svd(0.6))",
    "backward": "int8",
    "start_step": 2000,
    "min_numel": 4096,
    "overrides": {"labels": "none", "enc.*.bias": {"backward": "fp16"}, "enc.out": {"forward": "bf16"}},
}


def test_codecs_per_direction_after_the_start_step():
    policy = CompressionPolicy.from_dict(TABLE)
    assert policy.codec_for("forward", "h", 1 << 20, step=2000).spec == "fp16(svd(0.6))"
    assert policy.codec_for("backward", "h", 1 << 20, step=5000).spec == "int8"


def test_uncompressed_before_the_start_step():
    policy = CompressionPolicy.from_dict(TABLE)
    assert policy.codec_for("forward", "h", 1 << 20, step=1999).spec == "none"
    assert policy.codec_for("forward", "labels", 10, step=0).spec == "none"


def test_overrides_by_name_and_pattern_win_over_size_and_default():
    policy = CompressionPolicy.from_dict(TABLE)
    assert policy.codec_for("backward", "labels", 1 << 20, step=3000).spec == "none"
    assert policy.codec_for("backward", "enc.3.bias", 768, step=3000).spec == "fp16"  # below min_numel
    assert policy.codec_for("forward", "enc.3.bias", 1 << 20, step=3000).spec == "fp16(svd(0.6))"  # other dir
    assert policy.codec_for("forward", "enc.out", 1 << 20, step=3000).spec == "bf16"


def test_small_and_integer_tensors_go_uncompressed():
    policy = CompressionPolicy.from_dict(TABLE)
    assert policy.codec_for("forward", "h", 4095, step=3000).spec == "none"
    assert policy.codec_for("forward", "ids", 1 << 20, step=3000, dtype=torch.int64).spec == "none"


def test_defaults_send_everything_raw_and_to_dict_round_trips():
    assert CompressionPolicy.from_dict({}).codec_for("forward", "h", 10**6, 10**6).spec == "none"
    policy = CompressionPolicy.from_dict(TABLE)
    assert CompressionPolicy.from_dict(policy.to_dict()) == policy
    assert policy.forward == parse("fp16(svd(0.6))")


@pytest.mark.parametrize("change, words", [
    ({"start_step": -1}, "compression.start_step: expected a non-negative integer"),
    ({"start_step": "2000"}, "start_step"),
    ({"min_numel": 1.5}, "min_numel"),
    ({"forward": 5}, "compression.forward: expected a codec spec string"),
    ({"forward": "svd(2)"}, "compression.forward: codec 'svd': ratio=2.0 must be in (0, 1]"),
    ({"backward": "int9"}, "compression.backward: codec spec 'int9'"),
    ({"compress": "fp16"}, "unknown key(s) compress"),
    ({"overrides": ["labels"]}, "compression.overrides: expected a table"),
    ({"overrides": {"labels": {"sideways": "none"}}}, "forward and/or backward"),
    ({"overrides": {"labels": {"forward": "topk(0)"}}}, "compression.overrides.'labels'.forward"),
])
def test_invalid_tables_say_which_key_and_how_to_fix_it(change, words):
    with pytest.raises(ConfigError) as info:
        CompressionPolicy.from_dict({**TABLE, **change})
    assert words in str(info.value)


def test_unknown_direction_is_refused():
    with pytest.raises(ConfigError, match="forward"):
        CompressionPolicy.from_dict(TABLE).codec_for("sideways", "h", 1, 1)


@pytest.mark.parametrize("table", [{"forward": "delta(int8)", "backward": "delta(int8)"},
                                   {"overrides": {"hidden": {"backward": "delta(fp16)"}}},
                                   {"overrides": {"hidden": "delta(int8)"}}])  # a string names both directions
def test_delta_backward_is_refused_when_the_job_is_read(table):
    """Gradients carry no example ids: delta backward used to fail only at the first send, in the sender thread."""
    with pytest.raises(ConfigError, match=r"= 'delta\(.*gradients carry no example ids"):
        CompressionPolicy.from_dict(table, "links[0].compression")
