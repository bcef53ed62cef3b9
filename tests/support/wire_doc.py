"""What docs/protocol.md §1-3 shows, printed from the code: a vector's tensors (spec, input, meta, each
part's bytes and values, the decoded tensor), an envelope annotated field by field, and the envelope
sizes of a 25 MB activation per codec."""
from __future__ import annotations

import functools
import json
import textwrap
import zlib
from typing import Any

import numpy as np
import torch

from nebula._proto import nebula_pb2 as pb
from nebula.codecs import pack, unpack
from nebula.wire import decode_message, dtype_names, encode_message
from nebula_lab.bench.codecs import wire_message
from tests.support.threads import one_thread
from tests.vectors.make_delta import load as load_delta
from tests.vectors.make_wire import stored_vector, tensor_bytes

HEX_PER_LINE = 16
ACTIVATION = (128, 64, 768)  # `nebula bench codecs`'s activation: 25,165,824 bytes of float32
NAME = ROLE = "activation"  # its header's name and role, as the bench sends its activation row
SIZE_CODECS = ["none", "fp16", "bf16", "int8", "int8(scale=bf16)", "lowrank(0.2)", "fp16(lowrank(0.2))",
               "int8(lowrank(0.2))", "topk(0.01)", "fp16(topk(0.01))"]
VARINT, LENGTH = 0, 2


def short(value: Any, dtype: str) -> str:
    """float32: the shortest text that reads back as the same float32; float16 and bfloat16: the exact
    value (a few digits: they have 11 and 8 significant bits)."""
    if dtype == "bool":
        return "true" if value else "false"
    if dtype == "float32":
        return str(np.float32(value))
    if dtype in ("float16", "bfloat16"):
        return repr(float(value))
    return str(int(value))


def listed(x: torch.Tensor) -> str:
    dtype = dtype_names()[x.dtype]
    flat = x.reshape(-1).float().tolist() if x.dtype.is_floating_point else x.reshape(-1).tolist()
    return "[" + ", ".join(short(v, dtype) for v in flat) + "]"


def hex_lines(data: bytes, indent: int) -> list[str]:
    if not data:
        return [" " * indent + "(0 bytes)"]
    return [" " * indent + data[i:i + HEX_PER_LINE].hex(" ") for i in range(0, len(data), HEX_PER_LINE)]


def described(label: str, x: torch.Tensor) -> str:
    """`label dtype [shape] = values` (bytes, uint8, are only shown in hex)."""
    values = "" if x.dtype == torch.uint8 else f" = {listed(x)}"
    return f"{label:<9} {dtype_names()[x.dtype]} {list(x.shape)}{values}"


def render_vector(name: str) -> str:
    """One codec example: what the stored vector's frames hold and what the code decodes them to."""
    vector = stored_vector(name)
    msg = decode_message([bytes.fromhex(frame) for frame in vector["frames"]])
    lines = textwrap.wrap(f"{name}: {vector['about']}", 100)
    for tensor, stored in zip(msg.tensors, vector["tensors"]):
        lines.append(f"spec      {tensor.codec}")
        if "input" in stored:
            lines.append(f"input     {stored['input']['dtype']} {stored['input']['shape']} = "
                         + listed(torch.tensor(stored["input"]["values"]).to(_dtype(stored["input"]["dtype"]))))
        lines.append(f"meta      {tensor.meta.decode() or '(empty)'}")
        for j, part in enumerate(tensor.parts):
            lines.append(described(f"part {j}", part))
            lines += hex_lines(tensor_bytes(part), 10)
            if tensor.codec.startswith("deflate") and part.dtype == torch.uint8:
                lines.append("          inflated:")
                lines += hex_lines(zlib.decompress(tensor_bytes(part)), 10)
        lines.append(described("decoded", unpack(tensor)))
        if "residual" in stored:
            lines.append(f"residual  (sender only) {listed(torch.tensor(stored['residual']['values']))}")
    return "\n".join(lines) + "\n"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def annotate(data: bytes, descriptor=pb.Envelope.DESCRIPTOR, depth: int = 0) -> list[str]:
    """A protobuf message field by field: its bytes in hex, then `name = value`."""
    lines, pos = [], 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        field = descriptor.fields_by_number[key >> 3]
        if key & 7 == VARINT:
            value, pos = _varint(data, pos)
            enum = field.enum_type
            text = f"{field.name} = {value}" + (f" ({enum.values_by_number[value].name})" if enum else "")
            lines += _row(data[start:pos], text, depth)
            continue
        assert key & 7 == LENGTH, f"wire type {key & 7} is not used by nebula.proto"
        length, body_at = _varint(data, pos)
        body, pos = data[body_at:body_at + length], body_at + length
        if field.message_type is not None:
            lines += _row(data[start:body_at], f"{field.name}: a {field.message_type.name} of {length} bytes", depth)
            lines += annotate(body, field.message_type, depth + 1)
        elif field.type == field.TYPE_STRING:
            lines += _row(data[start:pos], f"{field.name} = {json.dumps(body.decode())}", depth)
        elif field.type == field.TYPE_BYTES:
            lines += _row(data[start:pos], f"{field.name} = {length} bytes {body.decode(errors='replace')}", depth)
        else:  # packed repeated integers
            packed, at = [], 0
            while at < len(body):
                value, at = _varint(body, at)
                packed.append(value)
            lines += _row(data[start:pos], f"{field.name} = {packed} (packed)", depth)
    return lines


def _row(data: bytes, text: str, depth: int) -> list[str]:
    width = 36
    chunks = [data[i:i + 10] for i in range(0, len(data), 10)]
    first = "   " * depth + chunks[0].hex(" ")
    rows = [f"{first:<{width}} {text}"]
    rows += ["   " * depth + chunk.hex(" ") for chunk in chunks[1:]]
    return rows


def render_envelope(name: str) -> str:
    """A message's frames: the envelope annotated, then each payload frame's bytes."""
    frames = [bytes.fromhex(frame) for frame in stored_vector(name)["frames"]]
    lines = [f"frame 0: the envelope, {len(frames[0])} bytes"] + annotate(frames[0])
    for k, frame in enumerate(frames[1:]):
        lines.append(f"frame {k + 1}: payload {k}, {len(frame)} bytes")
        lines += hex_lines(frame, 0)
    return "\n".join(lines) + "\n"


def longest_envelope(frames: list) -> int:
    """The envelope's size with every checksum at its longest varint (10 bytes): the size whatever the data."""
    env = pb.Envelope()
    env.ParseFromString(bytes(frames[0]))
    for tensor in env.tensors:
        for part in tensor.parts:
            part.checksum = (1 << 64) - 1
    return len(env.SerializeToString())


@functools.cache
def envelope_sizes() -> list[dict[str, Any]]:
    """Per codec: the envelope of `nebula bench codecs`'s activation message, at most, and what it is of
    the tensor's 25 MB and of the payload."""
    x = torch.randn(ACTIVATION, generator=torch.Generator().manual_seed(0))
    rows = []
    for spec in SIZE_CODECS:
        with one_thread():
            payload = pack(NAME, ROLE, x, spec)
        envelope = longest_envelope(encode_message(wire_message(payload)))
        rows.append({"codec": payload.codec, "parts": len(payload.parts), "meta": len(payload.meta),
                     "envelope": envelope, "of_tensor": 100 * envelope / (x.numel() * 4),
                     "of_payload": 100 * envelope / payload.wire_bytes})
    return rows


def render_sizes() -> str:
    lines = [f"{'codec':<20} {'parts':>5} {'meta B':>6} {'envelope B':>10} {'% of 25 MB':>10} {'% of payload':>12}"]
    for row in envelope_sizes():
        lines.append(f"{row['codec']:<20} {row['parts']:>5} {row['meta']:>6} {row['envelope']:>10} "
                     f"{row['of_tensor']:>10.5f} {row['of_payload']:>12.5f}")
    return "\n".join(lines) + "\n"


def _held(cache: list) -> str:
    return " ".join(f"{key}@{seq}" for key, seq, _ in cache)


def render_delta_stream() -> str:
    """tests/vectors/delta/streams.json message by message: rows, ids:tags, what the receiver did, and
    the caches after it (one line when both ends hold the same), with the ids each end evicted."""
    lines, before = [], {"sender": [], "receiver": []}
    for m in load_delta()["streams"][0]["messages"]:
        tags = " ".join(f"{key}:{tag}" for key, tag in zip(m["ids"], m["bases"]))
        outcome = ("lost on the way" if not m["delivered"] else
                   f"refused ({m['refused']['rule']})" if "refused" in m else
                   f"decoded: {sum(t == 0 for t in m['bases'])} direct, {sum(t != 0 for t in m['bases'])} delta")
        lines.append(f"{m['message']}  T={m['input']['shape'][1]:<4} {tags:<14} {outcome}")
        caches = {end: m[end]["cache"] for end in ("sender", "receiver")}
        for end in (("both",) if caches["sender"] == caches["receiver"] else ("sender", "receiver")):
            cache = caches["sender" if end == "both" else end]
            gone = [str(k) for k, _, _ in before["sender" if end == "both" else end]
                    if k not in {key for key, _, _ in cache}]
            lines.append(f"   {end:<9} {_held(cache)}" + (f"   (evicted {', '.join(gone)})" if gone else ""))
        before = caches
    return "\n".join(lines) + "\n"


def examples() -> dict[str, str]:
    """Every example block of docs/protocol.md §1-3, from the code."""
    out = {name: render_envelope(name) for name in ("message-two-tensors", "message-appended-base")}
    for name in ("none-int64-ids", "none-bfloat16", "fp16-rounding", "bf16-rounding", "int8-half-even",
                 "int8-one-block", "int8-reciprocal", "int8-tiny-block", "int4-nibbles", "svd-k2-layout",
                 "svd-k3-order", "svd-k-half-even", "lowrank-rank1",
                 "topk-half-even", "deflate-int64-ids", "deflate-float32", "ef-topk-step-1", "ef-topk-step-2",
                 "chain-int8-lowrank", "chain-fp16-topk", "chain-deflate-fp16", "chain-nested"):
        out[name] = render_vector(name)
    out["envelope-sizes"] = render_sizes()
    out["delta-stream"] = render_delta_stream()
    return out
