"""Spec strings: valid ones round-trip to their canonical form, anything else is a ConfigError."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula.codecs import canonical, parse
from nebula.codecs.chain import Chain
from nebula.codecs.int8 import Int8
from nebula.codecs.svd import Svd
from nebula.errors import ConfigError

ratios = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False).map(lambda r: round(r, 4) or 0.5)
space = st.sampled_from(["", " ", "  "])


@st.composite
def leaf(draw):
    """(spec text in a random but valid form, its canonical form)."""
    kind = draw(st.sampled_from(["none", "fp16", "bf16", "int8", "svd", "lowrank", "topk"]))
    s = draw(space)
    if kind in ("svd", "lowrank", "topk"):
        r = draw(ratios)
        key = {"svd": "ratio", "lowrank": "ratio", "topk": "fraction"}[kind]
        text = f"{kind}({s}{r}{s})" if draw(st.booleans()) else f"{kind}({key}{s}={s}{r})"
        return text, f"{kind}({r!r})" if kind != "lowrank" else f"lowrank({r!r})"
    if kind == "int8":
        block = draw(st.sampled_from([64, 16, 128]))
        scale = draw(st.sampled_from(["bf16", "fp32"]))
        text = f"int8({s}block{s}={s}{block},scale={scale})"
        extras = [f"block={block}"] * (block != 64) + [f"scale={scale}"] * (scale != "fp32")
        return text, f"int8({', '.join(extras)})" if extras else "int8"
    return (f"{kind}{s}()" if draw(st.booleans()) else kind), kind


@st.composite
def chain(draw, depth=0):
    text, canon = draw(leaf())
    if depth >= 3 or draw(st.booleans()):
        return text, canon
    inner_text, inner_canon = draw(chain(depth + 1))
    if draw(st.booleans()) and depth < 2:
        inner_text, inner_canon = f"ef({inner_text})", f"ef({inner_canon})"
    name, _, rest = text.partition("(")
    args = rest.rstrip(") ").strip()
    text = f"{name.strip()}({inner_text}{', ' + args if args else ''})"
    cname, _, crest = canon.partition("(")
    cargs = crest.rstrip(")")
    return text, f"{cname}({inner_canon}{', ' + cargs if cargs else ''})"


@settings(max_examples=300, deadline=None)
@given(chain())
def test_valid_specs_parse_to_their_canonical_form(pair):
    text, expected = pair
    codec = parse(text)
    assert codec.spec == expected == canonical(text)
    assert parse(codec.spec).spec == codec.spec


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=40), st.text(alphabet="()=,. 0123456789efkprsvdtnobilw_-+", max_size=40)))
def test_garbage_specs_raise_only_config_errors(text):
    try:
        codec = parse(text)
    except ConfigError:
        return
    assert parse(codec.spec).spec == codec.spec


def test_composition_builds_a_chain_with_the_inner_codec_first():
    codec = parse("int8(lowrank(0.2), block=128)")
    assert isinstance(codec, Chain) and codec.outer == Int8(block=128)
    assert codec.spec == "int8(lowrank(0.2), block=128)"
    assert parse("fp16(svd(0.6))").inner == Svd(0.6)


@pytest.mark.parametrize("text, canon", [
    ("int8(block=64)", "int8"), ("int8(128)", "int8(block=128)"), ("svd(1)", "svd(1.0)"),
    (" fp16 ( svd ( .6 ) ) ", "fp16(svd(0.6))"), ("lowrank(0.2, 16, 1)", "lowrank(0.2)"),
    ("lowrank(0.2, iters=2)", "lowrank(0.2, iters=2)"), ("topk(1e-2)", "topk(0.01)"),
    ("\t\n\r\f\vint8\v(\fblock\r=\n128\t)\f ", "int8(block=128)"),  # §3.1's whitespace, all of it
    ("delta(int8, first=int8, ram=1024)", "delta(int8)"), ("delta(int8, mb=8, ram=8)", "delta(int8, mb=8)"),
])
def test_canonical_forms(text, canon):
    assert canonical(text) == canon
