"""docs/protocol.md §1-3 (the wire, its limits, the codecs) against the code.

Every example block there is regenerated from the code (tests/support/wire_doc.py) and compared; the
field, dtype, limit and parameter tables are compared with the protobuf descriptors and the code's
constants; and the arithmetic the text states (int8's rounding, bfloat16's, k, the deflate transform,
the overflow thresholds) is written here again from the text alone, in numpy, and must agree with the
codecs bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from nebula._proto import nebula_pb2 as pb
from nebula.codecs import CODECS, CodecState, pack, parse, unpack
from nebula.codecs.base import MAX_DECODED_NUMEL
from nebula.codecs.deflate import MAX_DECODED_BYTES
from nebula.codecs.spec import MAX_DEPTH, MAX_SPEC_CHARS
from nebula.codecs.topk import MAX_INDEX
from nebula.errors import CodecError, ConfigError, WireError
from nebula.site.config import GatewayConfig
from nebula.transport.sockets import HARD_FRAME_LIMIT
from nebula.wire import (
    DEFAULT_LIMITS,
    ITEMSIZE,
    PROTOCOL_VERSION,
    RULES,
    Kind,
    Limits,
    Message,
    TensorPayload,
    decode_message,
    encode_message,
)
from tests.support.wire_doc import NAME, ROLE, examples

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BLOCK = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```[\w-]*\n(?P<body>.*?)```", re.S)


def wire_sections() -> str:
    """§1-3 of docs/protocol.md."""
    text = DOC.read_text()
    return text[text.index("\n## 1. "):text.index("\n## 4. ")]


def subsection(heading: str) -> str:
    """From `heading` to the next heading of its level or above."""
    text = wire_sections()
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(rf"\n#{{1,{level}}} ").search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row of `text` (header and rule rows left out)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]
    return [row for row in rows if not set(row[0]) <= set("-: ") and row[0] not in ("#", "dtype", "limit",
                                                                                      "parameter")]


@pytest.fixture(scope="module")
def made() -> dict[str, str]:
    return examples()


def test_every_example_block_of_sections_1_to_3_is_made_by_the_code(made):
    blocks = {m["name"]: m["body"] for m in BLOCK.finditer(wire_sections())}
    assert sorted(blocks) == sorted(made), "an example block of §1-3 has no generator, or one is missing"
    for name, body in made.items():
        assert blocks[name] == body, f"docs/protocol.md example {name} differs from the code's output"


def test_the_document_version_is_the_wire_version():
    """The version the document states (its top, §7) is what the envelope's `version` carries: its major."""
    text = DOC.read_text()
    major, minor = re.search(r"^\*\*Version (\d+)\.(\d+)\.\*\*", text, re.M).groups()
    assert int(major) == PROTOCOL_VERSION
    versions = text[text.index("\n## 7. Versions"):]
    assert f"This text is version **{major}.{minor}**" in versions and f"\n**{major}.{minor}**" in versions


def test_the_reference_message_names_its_tensor_as_the_size_table_sends_it():
    text = " ".join(subsection("### 1.6 Envelope size").split())
    assert f"its header's `name` and `role` both `{ROLE}`" in text and NAME == ROLE


def _type_text(field) -> str:
    scalar = {field.TYPE_UINT32: "uint32", field.TYPE_UINT64: "uint64", field.TYPE_INT64: "int64",
              field.TYPE_STRING: "string", field.TYPE_BYTES: "bytes"}
    kind = scalar.get(field.type) or f"`{(field.message_type or field.enum_type).name}`"
    return ("repeated " if field.is_repeated else "") + kind


@pytest.mark.parametrize("message", [pb.Envelope, pb.TensorHeader, pb.Part])
def test_the_field_tables_are_the_proto_fields(message):
    text = subsection("### 1.2 The envelope")
    tables = [block for block in text.split("\n\n") if block.startswith("| # |")]
    table = tables[[pb.Envelope, pb.TensorHeader, pb.Part].index(message)]
    documented = [(int(n), name.strip("`"), kind) for n, name, kind, _ in table_rows(table)]
    assert documented == [(f.number, f.name, _type_text(f)) for f in message.DESCRIPTOR.fields]


def test_the_dtype_table_is_the_wire_dtypes():
    rows = table_rows(subsection("### 1.4 Element types"))
    assert {row[0].strip("`"): int(row[1]) for row in rows} == ITEMSIZE


def test_the_kinds_in_the_envelope_table_are_the_enum():
    kind_row = next(row for row in table_rows(subsection("### 1.2 The envelope")) if row[1] == "`kind`")
    documented = dict((int(n), name) for n, name in re.findall(r"(\d) `([A-Z]+)`", kind_row[3]))
    assert documented == {v.number: v.name for v in pb.Kind.DESCRIPTOR.values if v.number}


def test_every_limit_in_the_table_is_the_codes_value():
    gateway = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    code = {**{f"Limits.{f.name}": getattr(DEFAULT_LIMITS, f.name) for f in dataclasses.fields(DEFAULT_LIMITS)},
            "[gateway] max_frames": gateway["max_frames"], "[gateway] max_message_bytes": gateway["max_message_bytes"],
            "HARD_FRAME_LIMIT": HARD_FRAME_LIMIT, "MAX_SPEC_CHARS": MAX_SPEC_CHARS, "MAX_DEPTH": MAX_DEPTH,
            "MAX_DECODED_NUMEL": MAX_DECODED_NUMEL, "MAX_DECODED_BYTES": MAX_DECODED_BYTES, "MAX_INDEX": MAX_INDEX}
    documented = {}
    for row in table_rows(wire_sections()[wire_sections().index("## 2. Limits"):wire_sections().index("## 3. ")]):
        value, power = re.fullmatch(r"(\d+)(?: \(2\^(\d+)(?: − 1)?\))?", row[1]).groups()
        if power is not None:  # the power of two the text gives is the value's
            assert int(value) in (2 ** int(power), 2 ** int(power) - 1)
        documented[row[0].strip("`")] = int(value)
    assert documented == code


def test_the_depth_limit_allows_nine_codec_names():
    nine = "fp16(" * 8 + "none" + ")" * 8
    assert nine.count("(") == MAX_DEPTH
    parse(nine)
    with pytest.raises(ConfigError, match="deeper"):
        parse("fp16(" + nine + ")")


def _signature(cls) -> str:
    params = [f.name if f.default is dataclasses.MISSING else f"{f.name}={f.default}"
              for f in dataclasses.fields(cls) if f.type not in ("Codec",)]
    return f"{cls.name}({', '.join(params)})" if params else cls.name


def test_each_leaf_codec_has_its_section_and_parameter_table():
    text = subsection("### 3.3 Leaf codecs")
    headings = re.findall(r"^#### `(.+)`$", text, re.M)
    leaves = [cls for name, cls in CODECS.items() if name not in ("ef", "delta")]
    assert sorted(headings) == sorted(_signature(cls) for cls in leaves)
    assert "### 3.4 `ef(inner)`" in wire_sections() and set(CODECS) - {cls.name for cls in leaves} == {"ef", "delta"}
    heading = "### 3.7 `delta(inner, mb=1024, first=inner, ram=mb)`"
    assert heading in wire_sections()
    rows = table_rows(subsection(heading))
    assert [row[0] for row in rows] == [f"`{f.name}`" for f in dataclasses.fields(CODECS["delta"])[1:]]
    assert rows[0][:2] == ["`mb`", "1024"] and rows[0][2].startswith("integer 1..1048576")
    assert rows[1][:2] == ["`first`", "`inner`"] and rows[1][2].startswith("a codec (not `delta`)")
    assert rows[2][:2] == ["`ram`", "`mb`"] and rows[2][2].startswith("integer 0..mb")
    _check_range(CODECS["delta"], dataclasses.fields(CODECS["delta"])[1], rows[0][2])
    for cls in leaves:
        body = subsection(f"#### `{_signature(cls)}`")
        rows = table_rows(body)
        fields = [f for f in dataclasses.fields(cls)]
        assert [row[0].strip("`") for row in rows] == [f.name for f in fields]
        for row, f in zip(rows, fields):
            assert row[1].strip("`") == ("required" if f.default is dataclasses.MISSING else str(f.default))
            _check_range(cls, f, row[2])


def _check_range(cls, f, text: str) -> None:
    """The values a parameter's row allows are what the codec accepts, and one past them is refused."""
    base = {g.name: 0.5 for g in dataclasses.fields(cls) if g.default is dataclasses.MISSING}
    if match := re.match(r"integer (\d+)\.\.(\d+)", text):
        low, high = int(match[1]), int(match[2])
        good, bad = [low, high], [low - 1, high + 1]
    elif text.startswith("float in (0, 1]"):
        good, bad = [1e-9, 1.0], [0.0, 1.0000001]
    else:
        good, bad = re.findall(r"`(\w+)`", text), ["fp16"]
    for value in good:
        cls(**{**base, f.name: value})
    for value in bad:
        with pytest.raises(ConfigError):
            cls(**{**base, f.name: value})


# ---- the arithmetic of §3.3, written again from the text -------------------------------------------------

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as §3.3 says: the binary32 bits plus 0x7fff plus bit 16, the upper half."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def int8_reference(x: np.ndarray, block: int, scale: str, levels: int = 127
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scales, decoded) from §3.3's rule (`int4`: the same with 7 levels)."""
    flat = x.astype(np.float32).reshape(-1)
    q, scales = np.empty(flat.size, np.int8), []
    for start in range(0, flat.size, block):
        part = flat[start:start + block]
        s = np.float32(np.abs(part).max() / np.float32(levels))
        if scale == "bf16":
            s = bf16_value(bf16_bits(np.array([s])))[0]
        with np.errstate(divide="ignore", over="ignore"):
            inv = np.float32(np.float32(1) / s)
        inv = np.float32(0) if np.isinf(inv) else inv
        q[start:start + block] = np.clip(np.rint(part * inv), -levels, levels)
        scales.append(s)
    scales = np.array(scales, np.float32)
    decoded = (q.astype(np.float32) * np.repeat(scales, block)[:flat.size]).reshape(x.shape)
    return q.reshape(x.shape), scales, decoded


def ties(rng: np.random.Generator, n: int) -> np.ndarray:
    """Blocks full of values whose x * inv or x / s land on or next to k + 0.5: where roundings differ."""
    amax = np.float32(rng.uniform(0.01, 10))
    s = np.float32(amax / np.float32(127))
    k = rng.integers(-127, 127, n) + 0.5
    x = (k * s.astype(np.float64)).astype(np.float32)
    x = np.nextafter(x, np.where(rng.random(n) < 0.5, -np.inf, np.inf).astype(np.float32)) if rng.random() < 0.5 else x
    x[0] = amax
    return x


@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_int8_is_the_documented_rounding_bit_for_bit(scale):
    rng = np.random.default_rng(14)
    inputs = [ties(rng, 64) for _ in range(40)] + [rng.standard_normal(1000).astype(np.float32) * 10.0 ** e
                                                   for e in (-30, -3, 0, 4)]
    inputs.append(np.array([0.0, -0.0, 0.0, 1e-38, -5e-39, 3e-39, 2.9e-39, 0.0], np.float32))
    differs = 0
    for i, x in enumerate(inputs):
        for block in (64, 7):
            q, scales, decoded = int8_reference(x, block, scale)
            payload = pack("x", "a", torch.from_numpy(x.copy()), f"int8(block={block}, scale={scale})")
            assert np.array_equal(payload.parts[0].numpy(), q)
            assert np.array_equal(payload.parts[1].float().numpy().view(np.uint32), scales.view(np.uint32))
            assert np.array_equal(unpack(payload).numpy().view(np.uint32), decoded.view(np.uint32))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                divided = np.rint(x / np.repeat(scales, block)[:x.size])
            differs += int((divided != q).sum()) if i < 40 else 0  # the tie blocks: normal, non-zero scales
    # the tie blocks are built around fp32 scales
    assert differs > 0 or scale == "bf16", \
        "no input where rint(x / s) and rint(x * fl(1/s)) differ: the test lost its point"


@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_int4_is_the_documented_rule_and_nibble_layout_bit_for_bit(scale):
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal(n).astype(np.float32) * 10.0 ** e for n, e in ((1000, 0), (777, -3), (65, 4))]
    inputs += [np.array([0.0, -0.0, 3.5, -2.5, 0.5, 7.0, 1e-38, 0.0, 0.0], np.float32)]  # ties, a zero block
    for x in inputs:
        for block in (64, 7, 2):
            q, scales, decoded = int8_reference(x, block, scale, levels=7)
            nibbles = np.append(q.astype(np.int16) + 8, [8] * (q.size % 2)).astype(np.uint8)
            payload = pack("x", "a", torch.from_numpy(x.copy()), f"int4(block={block}, scale={scale})")
            assert np.array_equal(payload.parts[0].numpy(), nibbles[0::2] | (nibbles[1::2] << 4))
            assert np.array_equal(payload.parts[1].float().numpy().view(np.uint32), scales.view(np.uint32))
            assert np.array_equal(unpack(payload).numpy().view(np.uint32), decoded.view(np.uint32))
    ratios = {spec: pack("x", "a", torch.randn(64 * 100), spec).wire_bytes / (64 * 100 * 4)
              for spec in ("int4", "int4(scale=fp32)")}
    assert ratios == {"int4": 0.1328125, "int4(scale=fp32)": 0.140625}


def test_the_thresholds_the_text_gives():
    def refused(spec, value):
        try:
            pack("x", "a", torch.tensor([value], dtype=torch.float32), spec)
        except CodecError:
            return True
        return False

    assert not refused("fp16", 65519.99) and refused("fp16", 65520.0)
    limit = np.float32((2 - 2 ** -8) * 2.0 ** 127)
    assert float(limit) == pytest.approx(3.3961776e38, rel=1e-7)
    assert not refused("bf16", float(np.nextafter(limit, np.float32(0)))) and refused("bf16", float(limit))
    for amax, zero in ((127 * 2.95e-39, False), (127 * 2.9e-39, True)):  # inv overflows below ~2.9e-39
        payload = pack("x", "a", torch.tensor([amax], dtype=torch.float32), "int8")
        assert float(payload.parts[1][0]) != 0 and (int(payload.parts[0][0]) == 0) == zero
    ratios = {spec: pack("x", "a", torch.randn(64 * 100), spec).wire_bytes / (64 * 100 * 4)
              for spec in ("int8", "int8(scale=bf16)")}
    assert ratios == {"int8": 0.265625, "int8(scale=bf16)": 0.2578125}


def test_bf16_and_fp16_are_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-40, 30, 5000),
                        # exactly halfway between two bfloat16 values, either sign: the ties
                        ((rng.integers(0, 0x7F00, 2000).astype(np.uint32) << 16) | 0x8000
                         | (rng.integers(0, 2, 2000).astype(np.uint32) << 31)).view(np.float32)])
    x = x[np.isfinite(x) & (np.abs(x) < 3e38)].astype(np.float32)
    bf16 = pack("x", "a", torch.from_numpy(x), "bf16").parts[0]
    assert np.array_equal(bf16.view(torch.int16).numpy().view(np.uint16), bf16_bits(x))
    small = x[np.abs(x) < 65504]
    fp16 = pack("x", "a", torch.from_numpy(small), "fp16").parts[0]
    assert np.array_equal(fp16.numpy(), small.astype(np.float16))


@pytest.mark.parametrize("m, n", [(1, 1), (2, 3), (5, 5), (3, 10), (7, 4), (10, 2), (6, 0)])
def test_k_is_the_documented_half_even_rounding(m, n):
    for ratio in (0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 1.0):
        payload = pack("x", "a", torch.randn(m, n), f"lowrank({ratio})")
        expected = 0 if min(m, n) == 0 else min(max(1, int(np.rint(np.float64(ratio) * min(m, n)))), m, n)
        assert payload.parts[0].shape == (m, expected) and payload.parts[1].shape == (expected, n)
        assert unpack(payload).shape == (m, n)
    for numel in (1, 3, 10, 30, 101):
        for fraction in (0.01, 0.05, 0.25, 0.5, 0.15):
            values, indices = pack("x", "a", torch.randn(numel), f"topk({fraction})").parts
            assert values.shape[0] == min(numel, max(1, int(np.rint(np.float64(fraction) * numel))))
            assert torch.equal(indices, indices.sort().values)


def zigzag_varints(values: np.ndarray) -> bytes:
    """§3.3's transform for int32 and int64, one element at a time."""
    out = bytearray()
    for v in values.astype(np.int64).tolist():
        z = ((v << 1) ^ (v >> 63)) & ((1 << 64) - 1)
        while True:
            out.append((z & 0x7F) | (0x80 if z >= 0x80 else 0))
            z >>= 7
            if not z:
                break
    return bytes(out)


def byte_shuffle(x: np.ndarray) -> bytes:
    return x.reshape(-1).view(np.uint8).reshape(x.size, x.itemsize).T.tobytes()


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "float16", "bfloat16", "int8", "uint8", "bool"])
def test_deflate_compresses_the_documented_transform(dtype):
    rng = np.random.default_rng(3)
    for values in (rng.integers(-300, 30000, 257), rng.integers(-2**31, 2**31 - 1, 40), np.zeros(0, np.int64)):
        x = torch.from_numpy(values).to(getattr(torch, dtype))
        payload = pack("x", "tokens", x, "deflate")
        meta = json.loads(payload.meta)
        raw = x.view(torch.int16).numpy() if dtype == "bfloat16" else x.numpy()
        varints = zigzag_varints(raw) if dtype in ("int32", "int64") else None
        shuffled = varints is None or len(varints) > x.numel() * x.element_size()
        assert list(meta) == ["dtype", "shape", "shuffle"][:3 if shuffled else 2]
        assert meta["dtype"] == dtype and meta["shape"] == [x.numel()] and meta.get("shuffle", False) == shuffled
        assert zlib.decompress(payload.parts[0].numpy().tobytes()) == (byte_shuffle(raw) if shuffled else varints)
        assert torch.equal(unpack(payload), x)


def test_chain_meta_is_the_documented_structure():
    payload = pack("x", "a", torch.randn(6, 5), "int8(fp16(topk(0.5)))")
    meta = json.loads(payload.meta)
    # topk's values go through fp16 (one float16 part), which int8 then encodes (values + scales): 2 parts
    assert meta == {"i": {"i": {"shape": [6, 5]}, "o": [[1, {}], None]}, "o": [[2, {}], None]}
    assert [p.dtype for p in payload.parts] == [torch.int8, torch.float32, torch.int32]
    assert math.prod(unpack(payload).shape) == 30
    assert len(payload.meta) <= DEFAULT_LIMITS.max_meta_bytes


# ---- refusals: §1.5's rules and §3.2's, as the code applies them --------------------------------------

def rule_table(heading: str) -> list[str]:
    """The first column of the first table under `heading` that has a `rule` column, backticks dropped."""
    text = subsection(heading)
    table = next(block for block in text.split("\n\n") if "| rule |" in block.split("\n")[0])
    header = [cell.strip() for cell in table.split("\n")[0].strip("|").split("|")]
    column = header.index("rule")
    return [cell for line in table.split("\n")[2:]
            for cell in re.findall(r"`([\w-]+)`", line.strip("|").split("|")[column])]


def test_the_receive_rules_are_the_codes_in_the_codes_order():
    assert rule_table("### 1.5 Receiving a message") == list(RULES)


def test_the_codec_rules_name_every_leaf_codec():
    rules = rule_table("### 3.2 Decoding a tensor")
    leaves = {name for name in CODECS if name not in ("ef", "delta")}
    assert set(rules) == leaves | {"spec", "meta", "chain", "delta", "elements", "conversion"}


def _breaking(rule: str) -> tuple[list[bytes], Limits]:
    """A message of 20 payload bytes, a body and a meta of 2 bytes each, and the small limits under which
    it breaks `rule`: the rules that no vector breaks in a few bytes."""
    x = TensorPayload("x", "activation", "float32", (2,), "none", b"{}", [torch.tensor([1.0, 2.0])])
    frames = [bytes(f) for f in encode_message(Message(Kind.TENSORS, job="demo", body=b"{}", tensors=[
        x, pack("y", "activation", torch.zeros(3), "none")]))]
    return frames, {"envelope-bytes": Limits(max_envelope_bytes=len(frames[0]) - 1),
                    "body-bytes": Limits(max_body_bytes=1), "frame-bytes": Limits(max_frame_bytes=8),
                    "message-bytes": Limits(max_message_bytes=19), "meta-bytes": Limits(max_meta_bytes=1)}[rule]


def test_every_receive_rule_refuses_a_message_that_breaks_it():
    """Each rule of §1.5 is raised by the code as that rule: by a vector of rejects.json, or, where only a
    large message breaks it, by a small one under small limits."""
    vectors = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "wire" / "rejects.json").read_text())
    by_vector = {reject["rule"] for reject in vectors["rejects"] if reject["error"] == "WireError"}
    for rule in set(RULES) - by_vector:
        frames, limits = _breaking(rule)
        decode_message(frames)  # the message itself is fine
        with pytest.raises(WireError) as refused:
            decode_message(frames, limits)
        assert refused.value.rule == rule
    assert by_vector <= set(RULES) and len(set(RULES) - by_vector) == 5


def test_every_reject_names_a_documented_rule():
    vectors = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "wire" / "rejects.json").read_text())
    codec_rules = set(rule_table("### 3.2 Decoding a tensor"))
    for reject in vectors["rejects"]:
        assert reject["rule"] in (set(RULES) if reject["error"] == "WireError" else codec_rules), reject["name"]


def test_a_decoded_tensor_is_converted_only_between_float_dtypes():
    half = pack("x", "activation", torch.tensor([0.1, 70000.0]), "none")
    assert unpack(dataclasses.replace(half, dtype="float16")).tolist() == [0.0999755859375, math.inf]
    assert unpack(dataclasses.replace(pack("x", "a", torch.ones(2), "int8"), dtype="bfloat16")).dtype == torch.bfloat16
    for spec, x, header in (("none", torch.tensor([1, 2], dtype=torch.int32), "int64"),
                            ("none", torch.tensor([1.0]), "int32"), ("fp16", torch.tensor([1.0]), "bool"),
                            ("deflate", torch.tensor([True]), "uint8")):
        with pytest.raises(CodecError, match="converts only between float dtypes"):
            unpack(dataclasses.replace(pack("x", "a", x, spec), dtype=header))


def test_a_delta_message_refused_for_its_header_dtype_leaves_the_cache_as_it_was():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    ids = torch.tensor([1, 2])
    unpack(pack("h", "activation", torch.ones(2, 4), "delta(int8)", state=sender, ids=ids), state=receiver)
    before = receiver["cache"].state_dict()
    payload = pack("h", "activation", torch.full((2, 4), 2.0), "delta(int8)", state=sender, ids=ids)
    with pytest.raises(CodecError, match="decodes float32 rows, the header says int64"):
        unpack(dataclasses.replace(payload, dtype="int64"), state=receiver)
    after = receiver["cache"].state_dict()
    assert after["seqs"].tolist() == before["seqs"].tolist() == [1, 1] and after["counts"] == before["counts"]
    assert unpack(payload, state=receiver).tolist() == [[2.0] * 4] * 2  # the same message, truthful, decodes


def test_the_depth_limit_counts_each_path_inwards_first_included():
    eight = "fp16(" * 7 + "none" + ")" * 7  # 8 names: depth 1 to 8 below a codec at depth 0
    spec = parse(f"delta({eight}, first={eight.replace('none', 'int8')})").spec
    assert len(re.findall(r"\b(?!first\b)[a-z]\w*", spec)) == 17  # 1 + 8 on each path
    for spec in (f"delta(fp16({eight}))", f"delta(int8, first=fp16({eight}))", f"fp16(fp16({eight}))"):
        with pytest.raises(ConfigError, match="nested deeper than 8"):
            parse(spec)


# ---- svd and lowrank: the sum order of §3.3, written again from the text ---------------------------------

def ordered_sum_reference(p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
    """§3.3's loop, element by element in float32: acc = p0[i, 0] p1[0, j], then acc + p0[i, t] p1[t, j]."""
    m, k = p0.shape
    out = np.zeros((m, p1.shape[1]), np.float32)
    for i in range(m):
        for j in range(p1.shape[1]):
            if k == 0:
                continue
            acc = np.float32(p0[i, 0] * p1[0, j])
            for t in range(1, k):
                acc = np.float32(acc + np.float32(p0[i, t] * p1[t, j]))
            out[i, j] = acc
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_svd_and_lowrank_decode_is_the_documented_sum_bit_for_bit(dtype):
    rng = np.random.default_rng(40)
    differs = 0
    for m, k, n in ((7, 1, 5), (6, 3, 4), (9, 17, 11), (4, 40, 3), (5, 0, 2), (1, 64, 1)):
        # magnitudes over 6 decades (float16's range) and zeros of either sign: where sum orders differ
        p0 = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 3, (m, k))).astype(np.float32)
        p1 = (rng.standard_normal((k, n)) * 10.0 ** rng.integers(-3, 3, (k, n))).astype(np.float32)
        p0[rng.random((m, k)) < 0.1] = -0.0
        u, v = torch.from_numpy(p0).to(dtype), torch.from_numpy(p1).to(dtype)
        want = ordered_sum_reference(u.float().numpy(), v.float().numpy())
        for spec in ("svd(1.0)", "lowrank(0.5)"):
            payload = TensorPayload("x", "activation", "float32", (m, n), spec, json.dumps({"shape": [m, n]}).encode(),
                                    [u, v])
            assert np.array_equal(unpack(payload).numpy().view(np.uint32), want.view(np.uint32)), (m, k, n, spec)
        differs += int((want.view(np.uint32) != (u.double() @ v.double()).float().numpy().view(np.uint32)).sum())
    assert differs > 0, "no input where the ordered float32 sum and a correctly rounded one differ: the test is moot"
