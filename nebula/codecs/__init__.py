"""Nebula's codec library (the paper's communication-optimisation layer, §2.3).

    payload = pack("h", "activation", x, "fp16(svd(0.6))", state=codec_state.slot(link, "h"))
    x2 = unpack(payload)

Spec grammar, wire layouts and measurements: docs/codecs.md; the normative layouts and arithmetic,
with worked examples: docs/protocol.md §3.
"""
# importing a codec module registers it
from nebula.codecs import bf16, deflate, delta, ef, fp16, int4, int8, lowrank, none, svd, topk  # noqa: F401,E401
from nebula.codecs.auto import Auto
from nebula.codecs.base import CODECS, Codec, register_codec
from nebula.codecs.chain import Chain
from nebula.codecs.packing import pack, unpack
from nebula.codecs.policy import CompressionPolicy, Phase, Setting
from nebula.codecs.policy_table import read_policy
from nebula.codecs.spec import canonical, parse
from nebula.codecs.state import CodecState

__all__ = ["CODECS", "Auto", "Chain", "Codec", "CodecState", "CompressionPolicy", "Phase", "Setting", "canonical",
           "pack", "parse", "read_policy", "register_codec", "unpack"]
