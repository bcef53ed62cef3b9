"""Wire format: round trips, zero-copy decoding, and every limit raising WireError naming the field."""
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula._proto import nebula_pb2 as pb
from nebula.errors import WireError
from nebula.wire import ITEMSIZE, Kind, Limits, Message, TensorPayload, decode_message, encode_message, parse_envelope


def tensor_msg(*parts, codec="none"):
    tensors = [TensorPayload(f"t{i}", "activation", "float32", tuple(p.shape), codec, b"{}", [p])
               for i, p in enumerate(parts)]
    return Message(kind=Kind.TENSORS, job="job", src="a/encoder/0", dst="b/decoder/0", seq=7, step=3,
                   micro_batch=1, tensors=tensors)


def as_bytes(frames):
    return [bytes(f) for f in frames]


def test_round_trip_keeps_every_field():
    x, y = torch.randn(4, 5, 6), torch.arange(10, dtype=torch.int64)
    msg = tensor_msg(x, y)
    msg.epoch, msg.topic, msg.body = 99, "stats", b'{"a": 1}'
    out = decode_message(as_bytes(encode_message(msg)))
    assert (out.kind, out.job, out.src, out.dst, out.seq, out.step, out.micro_batch, out.epoch) == \
        (Kind.TENSORS, "job", "a/encoder/0", "b/decoder/0", 7, 3, 1, 99)
    assert (out.topic, out.body) == ("stats", b'{"a": 1}')
    assert torch.equal(out.tensors[0].parts[0], x) and torch.equal(out.tensors[1].parts[0], y)
    assert out.tensors[0].codec == "none" and out.tensors[0].meta == b"{}"


def test_error_message_round_trip():
    msg = Message(kind=Kind.ERROR, error_code="unroutable", error_message="no route to site c")
    out = decode_message(encode_message(msg))
    assert (out.kind, out.error_code, out.error_message) == (Kind.ERROR, "unroutable", "no route to site c")


@pytest.mark.parametrize("dtype", [getattr(torch, name) for name in ITEMSIZE])
def test_every_dtype_round_trips(dtype):
    x = (torch.randn(3, 7) * 50).to(dtype)
    out = decode_message(as_bytes(encode_message(tensor_msg(x))))
    assert out.tensors[0].parts[0].dtype == dtype and torch.equal(out.tensors[0].parts[0], x)


def test_decoding_does_not_copy_payloads_and_header_is_tiny():
    x = torch.randn(128, 64, 768)  # 25 MB
    frames = encode_message(tensor_msg(x))
    assert len(frames[0]) <= 0.0001 * x.numel() * 4  # header <= 0.01% of the message
    part = decode_message(frames).tensors[0].parts[0]
    assert part.data_ptr() == x.data_ptr()


def test_zero_copy_through_a_real_zmq_socket_pair():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.linger = 0
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        x = torch.randn(256, 1024)
        push.send_multipart(encode_message(tensor_msg(x)), copy=False)
        assert pull.poll(5000)
        frames = pull.recv_multipart(copy=False)
        assert torch.equal(decode_message(frames).tensors[0].parts[0], x)
    finally:
        pull.close()
        push.close()


def envelope(**fields):
    env = pb.Envelope(version=1, kind=pb.TENSORS, **fields)
    return env


def test_limits_name_the_field():
    x = torch.randn(8)
    good = as_bytes(encode_message(tensor_msg(x)))
    cases = {
        "frames": ([], Limits()),
        "envelope.version": ([pb.Envelope(version=9, kind=1).SerializeToString()], Limits()),
        "envelope.kind": ([pb.Envelope(version=1, kind=77).SerializeToString()], Limits()),
        "envelope:": ([b"\xff" * 40], Limits()),
        "checksum": (good[:1] + [bytes(reversed(good[1]))], Limits()),
        "nbytes": (good[:1] + [good[1][:-4]], Limits()),
        "claims": (good[:1], Limits()),
        "payload frames but": (good + [b"x"], Limits()),
        "exceeds the limit": (good, Limits(max_frame_bytes=16)),
    }
    for field, (frames, limits) in cases.items():
        with pytest.raises(WireError, match=field):
            decode_message(frames, limits)


def test_header_lies_are_refused():
    def frames_with(mutate):
        env = pb.Envelope()
        frames = as_bytes(encode_message(tensor_msg(torch.randn(4, 4))))
        env.ParseFromString(frames[0])
        mutate(env)
        return [env.SerializeToString()] + frames[1:]

    def bad_dtype(env): env.tensors[0].parts[0].dtype = "complex64"
    def bad_rank(env): env.tensors[0].shape[:] = [1] * 9
    def negative(env): env.tensors[0].parts[0].shape[:] = [-4, -4]
    def first_payload(env): env.tensors[0].first_payload = 5
    def shape_bytes(env): env.tensors[0].parts[0].shape[:] = [4, 5]
    for mutate, field in [(bad_dtype, "dtype"), (bad_rank, "rank"), (negative, "negative"),
                          (first_payload, "first_payload"), (shape_bytes, "nbytes")]:
        with pytest.raises(WireError, match=field):
            decode_message(frames_with(mutate))


def test_parse_envelope_for_routing_ignores_payloads():
    frames = encode_message(tensor_msg(torch.randn(16)))
    env = parse_envelope(frames[0])
    assert env.dst == "b/decoder/0" and env.tensors[0].parts[0].nbytes == 64


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4)
dtype_names = st.sampled_from(sorted(ITEMSIZE))


@st.composite
def messages(draw):
    tensors, gen = [], torch.Generator().manual_seed(draw(st.integers(0, 2**31)))  # data must replay
    for _ in range(draw(st.integers(0, 4))):
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            dtype = getattr(torch, draw(dtype_names))
            parts.append((torch.randn(draw(shapes), generator=gen) * 100).to(dtype))
        tensors.append(TensorPayload(draw(st.text(max_size=12)), draw(st.sampled_from(["activation", "gradient"])),
                                     draw(dtype_names), tuple(draw(shapes)), draw(st.text(max_size=20)),
                                     draw(st.binary(max_size=64)), parts))
    return Message(kind=draw(st.sampled_from(list(Kind))), job=draw(st.text(max_size=10)),
                   src=draw(st.text(max_size=16)), dst=draw(st.text(max_size=16)),
                   seq=draw(st.integers(0, 2**64 - 1)), step=draw(st.integers(0, 2**64 - 1)),
                   micro_batch=draw(st.integers(0, 2**32 - 1)), tensors=tensors,
                   topic=draw(st.text(max_size=8)), body=draw(st.binary(max_size=64)),
                   epoch=draw(st.integers(0, 2**64 - 1)))


@settings(max_examples=150, deadline=None)
@given(messages())
def test_property_round_trip(msg):
    out = decode_message(as_bytes(encode_message(msg)))
    assert (out.kind, out.job, out.src, out.dst, out.seq, out.step, out.micro_batch, out.topic, out.body,
            out.epoch) == (msg.kind, msg.job, msg.src, msg.dst, msg.seq, msg.step, msg.micro_batch, msg.topic,
                           msg.body, msg.epoch)
    assert len(out.tensors) == len(msg.tensors)
    for got, sent in zip(out.tensors, msg.tensors):
        assert (got.name, got.role, got.dtype, got.shape, got.codec, got.meta) == \
            (sent.name, sent.role, sent.dtype, sent.shape, sent.codec, sent.meta)
        assert all(torch.equal(a, b) for a, b in zip(got.parts, sent.parts))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_property_garbage_frames_raise_only_wire_error(frames):
    try:
        decode_message(frames)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(messages(), st.data())
def test_property_corrupted_messages_raise_only_wire_error(msg, data):
    frames = as_bytes(encode_message(msg))
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    if frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= data.draw(st.integers(1, 255))
    else:
        frame = bytearray(b"\x01")
    frames[i] = bytes(frame)
    try:
        decode_message(frames)
    except WireError:
        pass
