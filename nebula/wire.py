"""Envelope + raw payload frames <-> ZeroMQ multipart messages.

A message is `[Envelope (protobuf), payload_0, payload_1, ...]`. Tensor bytes never go inside the
protobuf: each part of an encoded tensor is its own frame, sent and received with `copy=False`, so a
25 MB tensor is neither serialised nor copied by this layer. Every header says how to read its
frames (dtype, shape, codec spec), so a receiver needs no configuration. `decode_message` trusts
nothing: every limit violation raises `WireError` naming the field.
"""
from __future__ import annotations

import enum
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import xxhash
from google.protobuf.message import DecodeError

from nebula._proto import nebula_pb2 as pb
from nebula.errors import WireError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1

# the only dtypes a frame may carry: name -> itemsize. torch is imported only where tensors are
# touched, so a gateway (which routes envelopes and never decodes payloads) starts without it.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4, "int64": 8, "bool": 1}


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    import torch
    return {name: getattr(torch, name) for name in ITEMSIZE}


@functools.cache
def dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in torch_dtypes().items()}


class Kind(enum.IntEnum):
    TENSORS = pb.TENSORS
    CONTROL = pb.CONTROL
    ACK = pb.ACK
    HEARTBEAT = pb.HEARTBEAT
    ERROR = pb.ERROR


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts; anything beyond is refused before it is looked at further."""

    max_frames: int = 1025
    max_envelope_bytes: int = 1 << 16
    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 31
    max_tensors: int = 256
    max_rank: int = 8
    max_meta_bytes: int = 1 << 12
    max_body_bytes: int = 1 << 20


DEFAULT_LIMITS = Limits()

# The checks `decode_message` applies, in the order it applies them (docs/protocol.md §1.5): a refusal's
# `WireError.rule`. Normative with the error's class; its text is for people and may change.
RULES = ("frame-count", "envelope-bytes", "envelope-protobuf", "version", "kind", "tensor-count", "body-bytes",
         "frame-bytes", "message-bytes", "dtype", "rank", "negative-dimension", "dimension", "shape-bytes",
         "meta-bytes", "first-payload", "parts-exist", "nbytes", "checksum", "unclaimed-frames")


@dataclass
class TensorPayload:
    """One logical tensor as it travels: its decoded identity plus the encoded parts (one frame each)."""

    name: str
    role: str
    dtype: str  # dtype of the decoded tensor
    shape: tuple[int, ...]  # shape of the decoded tensor
    codec: str  # spec string, "none" for raw
    meta: bytes  # codec-private metadata
    parts: list[torch.Tensor]

    @property
    def wire_bytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


@dataclass
class Message:
    kind: Kind
    job: str = ""
    src: str = ""
    dst: str = ""
    seq: int = 0
    step: int = 0
    micro_batch: int = 0
    tensors: list[TensorPayload] = field(default_factory=list)
    topic: str = ""
    body: bytes = b""
    error_code: str = ""
    error_message: str = ""
    ack: int = 0
    epoch: int = 0
    generation: int = 0
    base: int = 0

    @property
    def payload_bytes(self) -> int:
        return sum(t.wire_bytes for t in self.tensors)


def checksum(buffer: Any) -> int:
    return xxhash.xxh3_64_intdigest(buffer)


def _as_buffer(part: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (bfloat16 and bool via a same-size int view)."""
    if part.device.type != "cpu" or not part.is_contiguous():
        raise WireError(f"payload parts must be contiguous CPU tensors, got {part.device} "
                        f"contiguous={part.is_contiguous()}")
    import torch
    if part.dtype == torch.bfloat16:  # numpy has no bfloat16: view as a same-size integer
        part = part.view(torch.int16)
    elif part.dtype == torch.bool:
        part = part.view(torch.uint8)
    if part.numel() == 0:
        return memoryview(b"")
    return part.reshape(-1).numpy().data.cast("B")


def encode_message(msg: Message) -> list[Any]:
    """Frames to pass to `socket.send_multipart(frames, copy=False)`."""
    env = pb.Envelope(version=PROTOCOL_VERSION, job=msg.job, src=msg.src, dst=msg.dst,
                      kind=msg.kind.value, seq=msg.seq, step=msg.step, micro_batch=msg.micro_batch,
                      topic=msg.topic, body=msg.body, ack=msg.ack, epoch=msg.epoch,
                      generation=msg.generation, base=msg.base)
    if msg.error_code or msg.error_message:
        env.error.code, env.error.message = msg.error_code, msg.error_message
    frames: list[Any] = [b""]
    for tensor in msg.tensors:
        header = env.tensors.add(name=tensor.name, role=tensor.role, dtype=tensor.dtype,
                                 shape=tensor.shape, codec=tensor.codec, codec_meta=tensor.meta,
                                 first_payload=len(frames) - 1)
        for part in tensor.parts:
            if part.dtype not in dtype_names():
                raise WireError(f"tensor {tensor.name!r}: dtype {part.dtype} cannot go on the wire")
            buffer = _as_buffer(part)
            header.parts.add(dtype=dtype_names()[part.dtype], shape=part.shape,
                             nbytes=buffer.nbytes, checksum=checksum(buffer))
            frames.append(buffer)
    frames[0] = env.SerializeToString()
    return frames


def with_base(envelope: bytes, base: int) -> bytes:
    """The envelope frame with `base` set, without re-encoding it: protobuf parses concatenated
    messages as their merge, and a later scalar wins. The reliable channel stamps each copy of a
    message as it hands it to the socket (the base moves as ACKs arrive)."""
    return bytes(envelope) + pb.Envelope(base=base).SerializeToString()


def _frame_buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer; bytes/memoryview as-is
    return memoryview(buffer).cast("B") if not isinstance(buffer, memoryview) else buffer.cast("B")


def parse_envelope(frame: Any, limits: Limits = DEFAULT_LIMITS) -> pb.Envelope:
    """Parse and check the envelope alone (what a gateway reads to route, never the payloads)."""
    raw = _frame_buffer(frame)
    if raw.nbytes > limits.max_envelope_bytes:
        raise WireError(f"envelope: {raw.nbytes} bytes exceeds the limit of {limits.max_envelope_bytes}",
                        "envelope-bytes")
    env = pb.Envelope()
    try:
        env.ParseFromString(raw.tobytes())
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise WireError(f"envelope: not a valid Envelope protobuf ({exc})", "envelope-protobuf") from exc
    if env.version != PROTOCOL_VERSION:
        raise WireError(f"envelope.version: {env.version} is not the supported {PROTOCOL_VERSION}", "version")
    if env.kind not in Kind._value2member_map_:
        raise WireError(f"envelope.kind: unknown kind {env.kind}", "kind")
    if len(env.tensors) > limits.max_tensors:
        raise WireError(f"envelope.tensors: {len(env.tensors)} exceeds the limit of {limits.max_tensors}",
                        "tensor-count")
    if len(env.body) > limits.max_body_bytes:
        raise WireError(f"envelope.body: {len(env.body)} bytes exceeds the limit of {limits.max_body_bytes}",
                        "body-bytes")
    return env


def _check_shape(where: str, dtype: str, shape: Sequence[int], limits: Limits) -> int:
    """Validate dtype and shape; return the byte count they imply."""
    if dtype not in ITEMSIZE:
        raise WireError(f"{where}.dtype: unknown dtype {dtype!r} (known: {', '.join(ITEMSIZE)})", "dtype")
    if len(shape) > limits.max_rank:
        raise WireError(f"{where}.shape: rank {len(shape)} exceeds the limit of {limits.max_rank}", "rank")
    if any(dim < 0 for dim in shape):
        raise WireError(f"{where}.shape: negative dimension in {list(shape)}", "negative-dimension")
    if any(dim > limits.max_message_bytes for dim in shape):  # with a 0 beside it the product would pass
        raise WireError(f"{where}.shape: a dimension of {list(shape)} exceeds the message limit", "dimension")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if nbytes > limits.max_message_bytes:
        raise WireError(f"{where}.shape: {list(shape)} implies {nbytes} bytes, over the message limit", "shape-bytes")
    return nbytes


def _view(buffer: memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Zero-copy tensor over a received frame (read-only memory: receivers must not write in place)."""
    import torch
    torch_dtype = torch_dtypes()[dtype]
    if buffer.nbytes == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": intended, see above
        return torch.frombuffer(buffer, dtype=torch_dtype).view(tuple(shape))


def _decode_tensor(i: int, header: pb.TensorHeader, payloads: list[memoryview], next_payload: int,
                   limits: Limits) -> TensorPayload:
    where = f"tensors[{i}] ({header.name!r})"
    _check_shape(where, header.dtype, header.shape, limits)
    if len(header.codec_meta) > limits.max_meta_bytes:
        raise WireError(f"{where}.codec_meta: {len(header.codec_meta)} bytes exceeds {limits.max_meta_bytes}",
                        "meta-bytes")
    if header.first_payload != next_payload:
        raise WireError(f"{where}.first_payload: {header.first_payload}, expected {next_payload} "
                        "(payload frames must be claimed in order, once each)", "first-payload")
    if next_payload + len(header.parts) > len(payloads):
        raise WireError(f"{where}.parts: claims {len(header.parts)} frames from index {next_payload} "
                        f"but only {len(payloads)} payload frames arrived", "parts-exist")
    parts = []
    for j, part in enumerate(header.parts):
        pwhere = f"{where}.parts[{j}]"
        nbytes = _check_shape(pwhere, part.dtype, part.shape, limits)
        buffer = payloads[next_payload + j]
        if not nbytes == part.nbytes == buffer.nbytes:
            raise WireError(f"{pwhere}.nbytes: shape {list(part.shape)} x {part.dtype} = {nbytes} bytes, "
                            f"header says {part.nbytes}, frame has {buffer.nbytes}", "nbytes")
        if checksum(buffer) != part.checksum:
            raise WireError(f"{pwhere}.checksum: frame bytes do not match the checksum", "checksum")
        parts.append(_view(buffer, part.dtype, part.shape))
    return TensorPayload(name=header.name, role=header.role, dtype=header.dtype, shape=tuple(header.shape),
                         codec=header.codec, meta=bytes(header.codec_meta), parts=parts)


def decode_message(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Frames as received (zmq.Frame with copy=False, bytes or memoryview) -> Message, or WireError."""
    if not 1 <= len(frames) <= limits.max_frames:
        raise WireError(f"frames: {len(frames)} frames, expected 1..{limits.max_frames}", "frame-count")
    env = parse_envelope(frames[0], limits)
    payloads = [_frame_buffer(frame) for frame in frames[1:]]
    for k, buffer in enumerate(payloads):
        if buffer.nbytes > limits.max_frame_bytes:
            raise WireError(f"payload[{k}]: {buffer.nbytes} bytes exceeds the limit of {limits.max_frame_bytes}",
                            "frame-bytes")
    if sum(buffer.nbytes for buffer in payloads) > limits.max_message_bytes:
        raise WireError(f"frames: total payload exceeds the limit of {limits.max_message_bytes} bytes", "message-bytes")
    tensors, next_payload = [], 0
    for i, header in enumerate(env.tensors):
        tensors.append(_decode_tensor(i, header, payloads, next_payload, limits))
        next_payload += len(header.parts)
    if next_payload != len(payloads):
        raise WireError(f"frames: {len(payloads)} payload frames but the headers claim {next_payload}",
                        "unclaimed-frames")
    return Message(kind=Kind(env.kind), job=env.job, src=env.src, dst=env.dst, seq=env.seq, step=env.step,
                   micro_batch=env.micro_batch, tensors=tensors, topic=env.topic, body=bytes(env.body),
                   error_code=env.error.code, error_message=env.error.message, ack=env.ack, epoch=env.epoch,
                   generation=env.generation, base=env.base)
