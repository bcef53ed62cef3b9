"""The wire conformance vectors (tests/vectors/wire/*.json): how each is built from the code, and how a
vector is printed in docs/protocol.md's worked examples.

    .venv/bin/python -m tests.vectors.make_wire --regenerate    # rewrites tests/vectors/wire/ from the code
    .venv/bin/python -m tests.vectors.make_wire                 # says which files differ from the code

A vector is one message: its frames in hex, the envelope as proto3 JSON, and per tensor the input the
encoder was given (if it was), how far an encoder must reproduce the frames (`encoder`), and the decoded
tensor (dtype, shape, row-major values, and their little-endian bytes in hex). A reject is a message a
receiver must refuse, with the error it raises.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
from google.protobuf.json_format import MessageToDict

from nebula._proto import nebula_pb2 as pb
from nebula.codecs import pack, unpack
from nebula.errors import CodecError, WireError
from nebula.wire import Kind, Message, TensorPayload, decode_message, dtype_names, encode_message, with_base

ROOT = Path(__file__).resolve().parent / "wire"
# every vector's envelope fields: few and small, so the hex stays readable
HEAD = {"job": "demo", "src": "a/enc/0", "dst": "b/dec/0", "seq": 1, "step": 1, "epoch": 1}
# how far a conformant encoder reproduces a vector from its input: bit for bit; factors that decode to
# the same values within `tol` (LAPACK's signs and last bits); the same bytes before zlib; not at all
# (parts written by hand: what a decoder must accept)
EXACT, FACTORS, ZLIB, DECODE_ONLY = "exact", "factors", "zlib", "decode-only"


@dataclasses.dataclass
class Vector:
    name: str
    about: str
    build: Callable[[], tuple[list[bytes], list[dict[str, Any]]]]  # -> frames, per tensor {input, encoder, ...}


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def frames_of(msg: Message) -> list[bytes]:
    return [bytes(frame) for frame in encode_message(msg)]


def tensors_message(*payloads: TensorPayload, **fields: Any) -> Message:
    return Message(kind=Kind.TENSORS, tensors=list(payloads), **{**HEAD, **fields})


def encoded(name: str, about: str, spec: str, x: torch.Tensor, encoder: str = EXACT, tol: float = 0.0) -> Vector:
    """One tensor `x` packed with `spec`."""
    return Vector(name, about, lambda: (frames_of(tensors_message(pack("x", "activation", x, spec))),
                                        [{"input": x, "encoder": encoder, "tol": tol}]))


def stepped(name: str, about: str, spec: str, steps: list[torch.Tensor], step: int) -> Vector:
    """Step `step` (1-based) of one stream packed with a sender state: what the earlier steps left in it."""

    def build():
        slot: dict = {}
        for x in steps[:step - 1]:
            pack("x", "gradient", x, spec, state=slot)
        payload = pack("x", "gradient", steps[step - 1], spec, state=slot)
        return frames_of(tensors_message(payload, step=step)), [
            {"input": steps[step - 1], "encoder": EXACT, "residual": slot["residual"]}]

    return Vector(name, about, build)


def hand(name: str, about: str, spec: str, shape: tuple, parts: list[torch.Tensor], meta: bytes = b"",
         dtype: str = "float32") -> Vector:
    """Parts written by hand: what any conformant encoder may send, and every decoder must decode."""
    payload = TensorPayload("x", "activation", dtype, shape, spec, meta, parts)
    return Vector(name, about, lambda: (frames_of(tensors_message(payload)), [{"input": None,
                                                                              "encoder": DECODE_ONLY}]))


def plain(name: str, about: str, msg: Message, base: int = 0) -> Vector:
    """A message as it is (`base`: appended to the encoded envelope, as the reliable channel does)."""

    def build():
        frames = frames_of(msg)
        if base:
            frames[0] = with_base(frames[0], base)
        return frames, [{"input": t.parts[0], "encoder": EXACT} for t in msg.tensors]

    return Vector(name, about, build)


def none_message() -> Message:
    return tensors_message(pack("x", "activation", f32(1.0, -1.0), "none"),
                           pack("ids", "tokens", torch.tensor([7, 8]), "none"))


def rank1(m: int, n: int) -> torch.Tensor:
    return torch.outer(torch.arange(1.0, m + 1), torch.linspace(1.0, -1.0, n))


EF_STEPS = [f32(4.0, -1.0, 0.5, 2.0), f32(1.0, 3.0, 1.0, 0.25)]

VECTORS: dict[str, list[Vector]] = {
    "none": [
        encoded("none-float32", "float32 as it is: 4 little-endian bytes per element, row-major", "none",
                torch.tensor([[1.0, -2.0], [0.1, 65536.0]])),
        encoded("none-int64-ids", "token ids, bit-exact: 8 little-endian bytes each", "none",
                torch.tensor([0, 1, 300, 1 << 40])),
        encoded("none-bfloat16", "bfloat16: the upper 16 bits of the float32, little-endian", "none",
                torch.tensor([1.0, -2.5, 0.1], dtype=torch.bfloat16)),
        encoded("none-float16", "IEEE binary16, little-endian", "none", torch.tensor([0.5, -0.1], dtype=torch.float16)),
        encoded("none-bool", "bool: one byte, 0 or 1", "none", torch.tensor([True, False, True])),
        encoded("none-int32-scalar", "a 0-d tensor: shape [], one element", "none",
                torch.tensor(-7, dtype=torch.int32)),
    ],
    "fp16": [
        encoded("fp16-rounding", "round to nearest even; 65519 is below the overflow threshold 65520; a subnormal",
                "fp16", f32(1.0, 0.1, -2.5, 65519.0, 6e-8, -0.0)),
    ],
    "bf16": [
        encoded("bf16-rounding", "round to nearest even to 8 significant bits; float32's range", "bf16",
                f32(1.0, 0.1, -2.5, 3.0e38, 1e-40)),
    ],
    "int8": [
        encoded("int8-half-even", "block 4: a full block with scale 1 (2.5 -> 2, 3.5 -> 4, -0.5 -> 0: half to "
                "even) and a short all-zero block (scale 0)", "int8(block=4)",
                torch.tensor([[127.0, 2.5, 3.5], [-0.5, 0.0, 0.0]])),
        encoded("int8-one-block", "the default block of 64 holds the whole tensor; q = rint(x * fl(1/s))", "int8",
                f32(0.3, -1.0, 0.05, 0.7)),
        encoded("int8-reciprocal", "x / s = 5.5 would round to 6; the encoder rounds x * fl(1/s) = 5.4999995 to 5",
                "int8", f32(1.0, 0.04330708459019661)),
        encoded("int8-bf16-scales", "bfloat16 scales, blocks of 2", "int8(block=2, scale=bf16)",
                f32(0.3, -1.0, 100.0, 7.0)),
        encoded("int8-float16-input", "a float16 tensor: decoded in float32, then rounded to the header's float16",
                "int8(block=4)", torch.tensor([0.1, -0.2, 0.3, 1.0], dtype=torch.float16)),
        encoded("int8-tiny-block", "absmax 1e-38: s = 7.87e-41 is not 0, but 1/s overflows to +Inf, so inv = 0 "
                "and every q is 0", "int8", f32(1e-38, -5e-39)),
    ],
    "int4": [
        encoded("int4-nibbles", "scale = absmax / 7; q + 8 in nibbles, element 2i low, 2i + 1 high; an odd count "
                "pads the last high nibble with 8 (a zero); bf16 scales", "int4",
                torch.tensor([[7.0, -7.0, 2.5], [3.5, -0.5, 1.0], [0.0, 0.25, 6.0]])),
        encoded("int4-blocks", "blocks of 2 with fp32 scales: one all-zero block (scale 0)",
                "int4(block=2, scale=fp32)", f32(0.7, -0.1, 0.0, 0.0, 14.0, 3.0)),
    ],
    "svd": [
        encoded("svd-rank1", "k = round(0.5 * min(2, 3)) = 1: U_1 S_1 (2, 1), V_1^T (1, 3)", "svd(0.5)",
                torch.tensor([[1.0, 2.0, 2.0], [2.0, 4.0, 4.0]]), FACTORS, 1e-6),
        encoded("svd-k-half-even", "k = round(0.5 * 5) = round(2.5) = 2 (half to even)", "svd(0.5)",
                torch.diag(f32(5.0, 4.0, 3.0, 2.0, 1.0)), FACTORS, 1e-6),
        hand("svd-k2-layout", "k = 2 from the parts' shapes: out[i, j] = sum_k US[i, k] * VT[k, j], row-major",
             "svd(1.0)", (3, 2), [torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                                  torch.tensor([[0.5, 0.0], [0.25, -1.0]])], b'{"shape":[3,2]}'),
        hand("svd-k3-order", "the sum in k order from the first product, each step rounded to float32, no fused "
             "multiply-add: 2^24 + 1 - 2^24 is 0 (1 summed from the end), fl((1 + 2^-12)^2) - 1 is 2^-11 (2^-11 + "
             "2^-24 fused), -0.0 three times is -0.0 (+0.0 summed from +0)", "svd(1.0)", (2, 3),
             [torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0 + 2**-12, 1.0]]),
              torch.tensor([[2.0**24, -1.0, -0.0], [1.0, 1.0 + 2**-12, -0.0], [-2.0**24, 0.0, -0.0]])],
             b'{"shape":[2,3]}'),
    ],
    "lowrank": [
        encoded("lowrank-rank1", "k = round(0.34 * 3) = 1", "lowrank(0.34)", rank1(4, 3), FACTORS, 1e-5),
        encoded("lowrank-3d", "a (2, 2, 3) tensor is the (4, 3) matrix; k = round(0.5 * 3) = 2", "lowrank(0.5)",
                torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, -2.0], [0.0, 1.0, 1.0], [0.0, 3.0, 3.0]]).view(2, 2, 3),
                FACTORS, 1e-5),
        encoded("lowrank-k3", "k = round(0.6 * 5) = 3: three products per element, summed in k order",
                "lowrank(0.6)", torch.tensor([[(i + 1) * (j + 2) % 7 - 3.0 for j in range(6)] for i in range(5)]),
                FACTORS, 1e-5),
        hand("lowrank-k2-layout", "the svd layout: U_k S_k (2, 2), V_k^T (2, 4)", "lowrank(0.5)", (2, 4),
             [torch.tensor([[1.0, 0.0], [2.0, 0.5]]), torch.tensor([[1.0, 2.0, 3.0, 4.0], [8.0, 0.0, -8.0, 2.0]])],
             b'{"shape":[2,4]}'),
    ],
    "topk": [
        encoded("topk-half-even", "k = round(0.25 * 10) = round(2.5) = 2; indices ascending", "topk(0.25)",
                torch.tensor([[0.5, -3.0, 0.25, 2.0, -0.125], [1.0, 4.0, -0.75, 0.0625, -1.5]])),
        encoded("topk-at-least-one", "k = max(1, round(0.01 * 3)) = 1", "topk(0.01)", f32(0.5, -2.0, 1.0)),
        hand("topk-any-order", "indices in any order (descending here): a decoder scatters each pair",
             "topk(0.5)", (4,), [f32(2.0, -1.0), torch.tensor([3, 0], dtype=torch.int32)], b'{"shape":[4]}'),
    ],
    "deflate": [
        encoded("deflate-int64-ids", "int64: zigzag LEB128 varints, then zlib", "deflate",
                torch.tensor([[0, 1, 63, 64], [-1, 300, 8191, 8192]]), ZLIB),
        encoded("deflate-int32-hashes", "int32 whose varints (14 bytes) would be longer than the raw 12: byte "
                "shuffle instead, meta says so", "deflate", torch.tensor([2**31 - 1, -2**31, 123456789],
                                                                          dtype=torch.int32), ZLIB),
        encoded("deflate-float32", "float32: byte planes (byte 0 of every element, then byte 1, ...)",
                "deflate(level=9)", f32(1.0, -2.0, 0.5), ZLIB),
        encoded("deflate-bool", "one-byte dtypes: as they are (a shuffle of 1-byte elements)", "deflate",
                torch.tensor([True, False, False, True]), ZLIB),
    ],
    "ef": [
        stepped("ef-topk-step-1", "step 1: no residual yet; what topk drops becomes the residual",
                "ef(topk(0.5))", EF_STEPS, 1),
        stepped("ef-topk-step-2", "step 2 encodes x + residual; the wire carries topk's parts only",
                "ef(topk(0.5))", EF_STEPS, 2),
    ],
    "chains": [
        encoded("chain-int8-lowrank", "int8(lowrank(0.2)): lowrank's two float32 factors, each int8-encoded "
                "(values, scales)", "int8(lowrank(0.2))", rank1(6, 5), FACTORS, 0.02),
        encoded("chain-fp16-topk", "fp16 re-encodes topk's float32 values; the int32 indices pass (null)",
                "fp16(topk(0.5))", f32(1.0, -8.0, 0.1, 3.0)),
        encoded("chain-deflate-fp16", "an outer codec's meta goes in the chain's entry", "deflate(fp16)",
                f32(1.0, 0.1, -2.0), ZLIB),
        encoded("chain-int4-fp16", "an inner codec without meta (M = {}: no shape, so the parts may decode to "
                "2^29 elements) and an outer one with a shape in its meta", "int4(fp16)", f32(1.0, 0.1, -2.0, 0.5)),
        encoded("chain-nested", "fp16(int8(topk(0.5))): topk, then int8 on its values, then fp16 on int8's "
                "float32 scales; int8's values and topk's indices pass", "fp16(int8(topk(0.5)))",
                f32(1.0, -8.0, 0.1, 3.0)),
    ],
    "messages": [
        plain("message-two-tensors", "two tensors: first_payload 0 and 1, one frame each", none_message()),
        plain("message-empty-and-scalar", "a (0,) tensor has a frame of 0 bytes; a 0-d tensor has shape []",
              tensors_message(pack("e", "activation", torch.zeros(0), "none"),
                              pack("s", "activation", torch.tensor(2.5), "none"))),
        plain("message-appended-base", "the reliable channel appends `base` to the encoded envelope; a protobuf "
              "parser merges it", tensors_message(pack("x", "activation", f32(1.0), "none")), base=3),
        plain("message-control", "CONTROL: topic and a JSON body, no payload frames",
              Message(kind=Kind.CONTROL, topic="stats", body=b'{"n":1}', **HEAD)),
        plain("message-ack", "ACK: the highest seq delivered in order, for the stream of `epoch`",
              Message(kind=Kind.ACK, job="", src="b/dec/0", dst="a/enc/0", ack=5, epoch=1, topic="resend")),
        plain("message-heartbeat", "HEARTBEAT ping to a gateway", Message(kind=Kind.HEARTBEAT, src="a/enc/0",
                                                                         dst="a/gateway/0", topic="ping")),
        plain("message-error", "ERROR from a gateway: code and message; topic holds the original dst",
              Message(kind=Kind.ERROR, src="a/gateway/0", dst="a/enc/0", seq=4, epoch=1, topic="c/x/0",
                      error_code="unroutable", error_message="no route to site c")),
    ],
}


# ---- rejects: messages a receiver must refuse -----------------------------------------------------------

def _mutated(change: Callable[[pb.Envelope, list[bytes]], None], msg: Message | None = None) -> list[bytes]:
    frames = frames_of(msg or tensors_message(pack("x", "activation", f32(1.0, 2.0), "none")))
    env = pb.Envelope()
    env.ParseFromString(frames[0])
    payloads = frames[1:]
    change(env, payloads)
    return [env.SerializeToString(), *payloads]


def _set(**fields) -> Callable[[pb.Envelope, list[bytes]], None]:
    def change(env, payloads):
        for key, value in fields.items():
            setattr(env, key, value)
    return change


def _flip(env, payloads):
    payloads[0] = bytes([payloads[0][0] ^ 1]) + payloads[0][1:]


def _shorten(env, payloads):
    payloads[0] = payloads[0][:-1]


def _swap(env, payloads):
    env.tensors[0].first_payload, env.tensors[1].first_payload = 1, 0


def _part(**fields):
    def change(env, payloads):
        for key, value in fields.items():
            if key == "shape":
                env.tensors[0].parts[0].ClearField("shape")
                env.tensors[0].parts[0].shape.extend(value)
            else:
                setattr(env.tensors[0].parts[0], key, value)
    return change


def _shape(*dims: int) -> Callable[[pb.Envelope, list[bytes]], None]:
    """Tensor 0's header shape (its part keeps its own)."""
    def change(env, payloads):
        env.tensors[0].ClearField("shape")
        env.tensors[0].shape.extend(dims)
    return change


def _headers(count: int) -> Callable[[pb.Envelope, list[bytes]], None]:
    def change(env, payloads):
        for _ in range(count - len(env.tensors)):
            env.tensors.add()
    return change


def _codec_reject(spec: str, x: torch.Tensor, **changes) -> list[bytes]:
    payload = dataclasses.replace(pack("x", "activation", x, spec), **changes)
    return frames_of(tensors_message(payload))


def _missing_and_corrupt(env, payloads):
    """Tensor 0 claims two frames: the first corrupt, the second missing."""
    part = env.tensors[0].parts.add()
    part.CopyFrom(env.tensors[0].parts[0])
    _flip(env, payloads)


def _chain_reject(spec: str, x: torch.Tensor, change: Callable[[dict], None]) -> list[bytes]:
    """`x` packed with the chain `spec`, its meta changed by `change`."""
    payload = pack("x", "activation", x, spec)
    meta = json.loads(payload.meta)
    change(meta)
    return frames_of(tensors_message(dataclasses.replace(payload, meta=json.dumps(meta, separators=(",", ":"))
                                                         .encode())))


def _expand(meta: dict) -> None:
    meta["o"][0][1]["shape"] = [5000]  # 4 x 4 + 4096 = 4112 elements at most for the (4,) tensor


def _unaccounted(meta: dict) -> None:
    meta["o"] = meta["o"][:1]  # topk's indices pass, and no entry says so


TOO_DEEP = "fp16(" * 9 + "none" + ")" * 9  # 10 codec names: depth 9

# (name, about, rule, frames): the rule is the check of docs/protocol.md §1.5 (a WireError, where the code
# names it too: WireError.rule) or of §3 (a CodecError) that refuses the message
REJECTS: list[tuple[str, str, str, Callable[[], list[bytes]]]] = [
    ("reject-no-frames", "a message has 1 to 1025 frames", "frame-count", lambda: []),
    ("reject-not-protobuf", "the envelope frame must parse as an Envelope", "envelope-protobuf",
     lambda: [b"\xff\xff\xff"]),
    ("reject-version", "version must be 1", "version", lambda: _mutated(_set(version=2))),
    ("reject-kind", "kind 0 (unspecified) and unknown kinds", "kind", lambda: _mutated(_set(kind=0))),
    ("reject-checksum", "one payload bit flipped", "checksum", lambda: _mutated(_flip)),
    ("reject-nbytes", "a frame one byte short of shape x itemsize", "nbytes", lambda: _mutated(_shorten)),
    ("reject-extra-frame", "a payload frame no header claims", "unclaimed-frames",
     lambda: _mutated(lambda env, payloads: payloads.append(b"\x00"))),
    ("reject-missing-frame", "a header claims a frame that is not there", "parts-exist",
     lambda: _mutated(lambda e, p: p.pop())),
    ("reject-order", "parts must be claimed in order: tensor 0 from frame 0", "first-payload",
     lambda: _mutated(_swap, none_message())),
    ("reject-rank", "rank 9 (the limit is 8)", "rank", lambda: _mutated(_shape(*[1] * 8, 2))),
    ("reject-dtype", "a part dtype outside the table", "dtype", lambda: _mutated(_part(dtype="float64"))),
    ("reject-negative-dim", "a negative dimension", "negative-dimension", lambda: _mutated(_part(shape=[-2]))),
    ("reject-topk-duplicate", "an index twice: which value wins is undefined", "topk",
     lambda: _codec_reject("topk(0.5)", f32(1.0, 2.0, 3.0, 4.0),
                           parts=[f32(1.0, 2.0), torch.tensor([3, 3], dtype=torch.int32)])),
    ("reject-int8-scales", "ceil(numel / block) scales, not fewer", "int8",
     lambda: _codec_reject("int8(block=2)", f32(1.0, 2.0, 3.0), parts=[torch.tensor([1, 2, 3], dtype=torch.int8),
                                                                     f32(1.0)])),
    ("reject-int4-nibbles", "ceil(numel / 2) bytes of nibbles for the meta's shape, not fewer", "int4",
     lambda: _codec_reject("int4", f32(1.0, 2.0, 3.0), parts=[torch.tensor([0x99], dtype=torch.uint8),
                                                             torch.tensor([1.0], dtype=torch.bfloat16)],
                           meta=b'{"shape":[3]}')),
    ("reject-meta-json", "codec_meta must be a JSON object", "meta",
     lambda: _codec_reject("topk(0.5)", f32(1.0, 2.0), meta=b"[2]")),
    ("reject-deflate-trailing", "bytes after the zlib stream", "deflate",
     lambda: _codec_reject("deflate", torch.tensor([1, 2]), parts=[torch.frombuffer(
         bytearray(zlib.compress(b"\x02\x04") + b"\x00"), dtype=torch.uint8)])),
    ("reject-tensor-count", "257 tensor headers (the limit is 256), checked with the envelope", "tensor-count",
     lambda: _mutated(_headers(257))),
    ("reject-dimension", "a dimension over 2^31 beside a 0: the product alone would pass", "dimension",
     lambda: _mutated(_shape(0, 2**31 + 1))),
    ("reject-shape-bytes", "2^20 x 2^10 float32 elements imply 2^32 bytes, over the 2^31 of a message",
     "shape-bytes", lambda: _mutated(_shape(2**20, 2**10))),
    ("reject-missing-before-checksum", "a header's parts must all exist before any part is checked: part 0's "
     "checksum is wrong too, but part 1's frame is missing", "parts-exist", lambda: _mutated(_missing_and_corrupt)),
    ("reject-lossy-to-int", "fp16 decodes to float32, the header says int32: only float to float is converted",
     "conversion", lambda: _codec_reject("fp16", f32(1.0, 2.0), dtype="int32")),
    ("reject-none-int32-as-int64", "none's part is int32, the header says int64: no integer conversion",
     "conversion", lambda: _codec_reject("none", torch.tensor([1, 2], dtype=torch.int32), dtype="int64")),
    ("reject-chain-expands", "an entry's outer meta says 5000 elements, over 4 x 4 + 4096 for the (4,) tensor the "
     "inner meta names: refused before decoding", "chain",
     lambda: _chain_reject("topk(topk(0.5), 0.5)", f32(1.0, -2.0, 3.0, 0.5), _expand)),
    ("reject-chain-unaccounted", "every part must be accounted for: the entries name 2 of the 3 parts", "chain",
     lambda: _chain_reject("int8(topk(0.5))", f32(1.0, -2.0, 3.0, 0.5), _unaccounted)),
    ("reject-spec-depth", "10 codec names: a codec at depth 9, over MAX_DEPTH 8", "spec",
     lambda: frames_of(tensors_message(TensorPayload("x", "activation", "float32", (1,), TOO_DEEP, b"",
                                                     [f32(1.0)])))),
]


def refusal(frames: list[bytes]) -> tuple[str, str, str]:
    """(error class, the rule the code names, Nebula's text up to the first parenthesis after the field)
    the receiver raises: WireError from decode_message, CodecError from unpack. Only the class and the
    rule are normative (docs/protocol.md §1.5); the code names the rule of a WireError, and its text
    starts with the field. What follows a later parenthesis (a parser's own words, a hint) is left out."""
    try:
        msg = decode_message(frames)
        for tensor in msg.tensors:
            unpack(tensor)
    except (WireError, CodecError) as exc:
        field, colon, rest = str(exc).partition(": ")
        return type(exc).__name__, getattr(exc, "rule", ""), field + colon + rest.split(" (")[0]
    return "", "", "accepted"


# ---- JSON ------------------------------------------------------------------------------------------------

def tensor_bytes(x: torch.Tensor) -> bytes:
    return bytes(x.contiguous().reshape(-1).view(torch.uint8).numpy())


def values(x: torch.Tensor) -> list:
    """Row-major values: ints, bools, or the float64 that equals each float exactly."""
    flat = x.reshape(-1)
    if x.dtype.is_floating_point:
        return [float(v) for v in flat.float().tolist()]
    return flat.tolist()


def described(x: torch.Tensor) -> dict[str, Any]:
    return {"dtype": dtype_names()[x.dtype], "shape": list(x.shape), "values": values(x),
            "hex": tensor_bytes(x).hex()}


def vector_json(vector: Vector) -> dict[str, Any]:
    frames, infos = vector.build()
    msg = decode_message(frames)
    env = pb.Envelope()
    env.ParseFromString(frames[0])
    out: dict[str, Any] = {"name": vector.name, "about": vector.about, "frames": [f.hex() for f in frames],
                           "envelope": MessageToDict(env, preserving_proto_field_name=True), "tensors": []}
    for tensor, info in zip(msg.tensors, infos):
        entry = {"name": tensor.name, "codec": tensor.codec, "meta": tensor.meta.decode(),
                 "encoder": info["encoder"]}
        if info["encoder"] == FACTORS:
            entry["tol"] = info["tol"]
        if info["input"] is not None:
            entry["input"] = described(info["input"])
        entry["decoded"] = described(unpack(tensor))
        if "residual" in info:
            entry["residual"] = described(info["residual"])
        out["tensors"].append(entry)
    return out


def reject_json(name: str, about: str, rule: str, build: Callable[[], list[bytes]]) -> dict[str, Any]:
    frames = build()
    error, named, message = refusal(frames)
    if named and named != rule:
        raise AssertionError(f"{name}: built to break rule {rule!r}, the code refuses it by {named!r}")
    return {"name": name, "about": about, "frames": [f.hex() for f in frames], "error": error, "rule": rule,
            "message": message}


def generate() -> dict[str, dict[str, Any]]:
    """File name -> content, from the code."""
    files = {f"{group}.json": {"vectors": [vector_json(v) for v in vectors]} for group, vectors in VECTORS.items()}
    files["rejects.json"] = {"rejects": [reject_json(*reject) for reject in REJECTS]}
    return files


def dumps(content: dict[str, Any]) -> str:
    """Indented JSON with each short list of numbers or strings on one line."""

    def inline(match: re.Match) -> str:
        items = ", ".join(item.strip() for item in match.group(1).split(",\n"))
        return f"[{items}]" if len(items) <= 100 else match.group(0)

    return re.sub(r"\[\n\s*([^\[\]{}]*?)\n\s*\]", inline, json.dumps(content, indent=1)) + "\n"


def load(file: str) -> dict[str, Any]:
    return json.loads((ROOT / file).read_text())


def stored_vector(name: str) -> dict[str, Any]:
    for path in sorted(ROOT.glob("*.json")):
        for vector in json.loads(path.read_text()).get("vectors", []):
            if vector["name"] == name:
                return vector
    raise KeyError(f"no wire vector named {name!r}; regenerate: python -m tests.vectors.make_wire --regenerate")


def write_or_check(files: dict[str, dict[str, Any]], root: Path, doc: str | None) -> int:
    """A generator's command line: `--regenerate` writes `files` under `root`; without it, say which
    differ from what is there (exit 1 if any)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--regenerate", action="store_true", help=f"rewrite {root.name}/ from the code")
    args = parser.parse_args()
    if not args.regenerate:
        stale = [name for name, content in files.items()
                 if not (root / name).exists() or (root / name).read_text() != dumps(content)]
        print("differ from the code: " + ", ".join(stale) if stale else "all vectors match the code")
        return 1 if stale else 0
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (root / name).write_text(dumps(content))
    print(f"wrote {len(files)} files to {root}")
    return 0


def main() -> int:
    return write_or_check(generate(), ROOT, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
