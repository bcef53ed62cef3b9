"""`delta(inner)`: per-example differences against caches kept at both ends (docs/protocol.md §3.7)."""
from __future__ import annotations

import io
import math
import re

import pytest
import torch

from nebula.codecs import Chain, Codec, CodecState, pack, parse, unpack
from nebula.codecs.delta import ENTRY_BYTES, MIB
from nebula.codecs.ef import ErrorFeedback
from nebula.errors import CodecError, ConfigError
from nebula.wire import Kind, Message, decode_message, encode_message

IDS = torch.tensor([11, -3, 1 << 40, 7], dtype=torch.int64)


def activations(seed: int = 0, shape=(4, 24, 384)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def drift(x: torch.Tensor, seed: int, step: float = 0.01) -> torch.Tensor:
    """The next visit's activations: a small change, as after one optimiser step of an adapter."""
    return x + step * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))


def through_wire(payload):
    frames = encode_message(Message(Kind.TENSORS, tensors=[payload]))
    return decode_message([bytes(f) for f in frames]).tensors[0]


def send(x, spec, sender, receiver, ids=IDS):
    payload = pack("h", "activation", x, spec, state=sender, ids=ids)
    return payload, unpack(through_wire(payload), state=receiver)


def error(y, x) -> float:
    return float((y - x).norm() / x.norm())


@pytest.mark.parametrize("inner", ["int8", "int8(lowrank(0.5))"])
def test_first_visit_is_direct_and_the_second_a_delta_with_less_error(inner):
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x1 = activations()
    payload, y1 = send(x1, f"delta({inner})", sender, receiver)
    direct = unpack(pack("h", "activation", x1, inner))
    assert torch.equal(y1, direct)  # a first visit decodes as the inner codec alone would
    assert payload.parts[1].tolist() == [0, 0, 0, 0]  # every row direct
    x2 = drift(x1, 1)
    payload2, y2 = send(x2, f"delta({inner})", sender, receiver)
    alone = pack("h", "activation", x2, inner)
    assert payload2.parts[1].tolist() == [1, 1, 1, 1]  # every row a delta against message 1's base
    assert payload2.wire_bytes <= alone.wire_bytes + 2 * 8 * len(IDS) + 64  # ids, bases, a longer meta
    assert error(y2, x2) < 0.1 * error(unpack(alone), x2)
    assert sender["cache"].stats() == {**receiver["cache"].stats()} == {
        "hits": 4, "misses": 4, "evictions": 0, "entries": 4, "bytes": 4 * 24 * 384 * 4, "cap_bytes": 1024 * MIB,
        "spilled": 0, "read_back": 0, "ram_bytes": 4 * 24 * 384 * 4, "ram_cap_bytes": 1024 * MIB, "disk_bytes": 0,
        "disk_file_bytes": 0}


def test_both_ends_hold_bit_identical_bases_and_errors_do_not_pile_up():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x, errors = activations(), []
    for visit in range(6):
        _, y = send(x, "delta(int8(lowrank(0.5)))", sender, receiver)
        errors.append(error(y, x))
        for key in IDS.tolist():
            assert torch.equal(sender["cache"].get(key)[1], receiver["cache"].get(key)[1])
        x = drift(x, visit + 1)
    assert errors[-1] < errors[1] < 0.05 * errors[0]  # each delta also carries the last visit's error


def test_new_and_seen_examples_mix_in_one_message():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations()
    send(x[:2], "delta(int8)", sender, receiver, ids=IDS[:2])
    x2 = drift(x, 1)
    payload, y = send(x2, "delta(int8)", sender, receiver)
    assert payload.parts[1].tolist() == [1, 1, 0, 0]
    assert error(y[:2], x2[:2]) < 0.1 * error(y[2:], x2[2:])
    assert torch.equal(y[2:], unpack(pack("h", "activation", x2[2:], "int8")))


def test_the_wire_layout_is_the_documented_one():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations(shape=(4, 2, 64))
    send(x[:1], "delta(int8)", sender, receiver, ids=IDS[:1])
    payload, _ = send(x, "delta(int8)", sender, receiver)
    assert payload.meta == b'{"seq":2,"row":[2,64],"d":[2,{}],"r":[2,{}]}'
    ids, tags, direct_q, direct_s, delta_q, delta_s = payload.parts
    assert ids.tolist() == IDS.tolist() and tags.tolist() == [1, 0, 0, 0]
    assert direct_q.shape == (3, 2, 64) and delta_q.shape == (1, 2, 64) and delta_s.shape == (2,)
    base = unpack(pack("h", "activation", x[:1], "int8"))  # message 1 sent example 11 direct
    assert torch.equal(delta_q, pack("h", "activation", x[:1] - base, "int8").parts[0])
    assert torch.equal(direct_q, pack("h", "activation", x[1:], "int8").parts[0])


def test_rows_without_a_base_go_through_first_and_differences_through_inner():
    """`first` carries the whole activation of a first visit, whose loss every later delta inherits."""
    spec = "delta(int8(lowrank(0.1)), first=int8)"
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations(shape=(4, 24, 64))
    _, y1 = send(x[:1], spec, sender, receiver, ids=IDS[:1])
    assert torch.equal(y1, unpack(pack("h", "activation", x[:1], "int8")))
    base = receiver["cache"].get(int(IDS[0]))[1]
    x2 = drift(x, 1)
    payload, y = send(x2, spec, sender, receiver)
    assert payload.parts[1].tolist() == [1, 0, 0, 0]
    direct = pack("h", "activation", x2[1:], "int8")
    assert payload.meta.startswith(b'{"seq":2,"row":[24,64],"d":[2,{}],"r":[')  # int8's two parts, then lowrank's
    assert torch.equal(payload.parts[2], direct.parts[0]) and torch.equal(y[1:], unpack(direct))
    difference = unpack(pack("h", "activation", x2[:1] - base.unsqueeze(0), "int8(lowrank(0.1))"))
    assert torch.allclose(y[:1], base + difference, atol=1e-6)
    _, alone = send(x2, "delta(int8(lowrank(0.1)))", *(CodecState().slot("a->b", "h") for _ in range(2)))
    assert error(y[1:], x2[1:]) < error(alone[1:], x2[1:]) / 10  # int8 keeps far more than a 0.1 low rank


def test_evicted_examples_go_direct_at_both_ends_alike():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations(shape=(6, 255, 1024))  # rows of 1 MiB less 4 KiB: with ENTRY_BYTES each, 3 MiB holds 3
    ids = torch.arange(6, dtype=torch.int64)
    send(x, "delta(int8, mb=3)", sender, receiver, ids=ids)
    assert sorted(k for k in ids.tolist() if sender["cache"].get(k)) == [3, 4, 5]
    payload, y = send(drift(x, 1), "delta(int8, mb=3)", sender, receiver, ids=ids)
    assert payload.parts[1].tolist() == [0, 0, 0, 1, 1, 1]
    assert sender["cache"].stats() == receiver["cache"].stats()
    # message 1 evicted 0-2; message 2 put 0-2 (evicting 3-5, their bases already read), then 3-5 (evicting 0-2)
    assert sender["cache"].stats()["evictions"] == 9 and sender["cache"].stats()["hits"] == 3


def same_caches(sender, receiver) -> bool:
    """The same entries in the same order of use, with the same seqs and bit-identical rows."""
    a, b = sender["cache"].state_dict(), receiver["cache"].state_dict()
    return (torch.equal(a["ids"], b["ids"]) and torch.equal(a["seqs"], b["seqs"])
            and all(torch.equal(r, q) for r, q in zip(a["rows"], b["rows"])))


@pytest.mark.parametrize("row", [(0,), (1,), (3, 0)])
def test_rows_of_no_or_few_elements_count_against_the_cap_at_both_ends(row):
    """Each entry costs ~600 B of objects at any size: counted as 4 bytes per element alone, 9,000 empty
    rows under a 1 MiB cap were all kept (and a peer could grow the receiver's memory without bound)."""
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    most = MIB // (ENTRY_BYTES + 4 * math.prod(row))  # entries that fit in mb=1
    for message in range(3):
        ids = torch.arange(message * 3000, (message + 1) * 3000, dtype=torch.int64)
        send(torch.randn(3000, *row), "delta(int8, mb=1)", sender, receiver, ids=ids)
        assert len(receiver["cache"]) == len(sender["cache"]) == most
        assert same_caches(sender, receiver)
    assert receiver["cache"].stats() == sender["cache"].stats()
    assert sender["cache"].stats()["evictions"] == 9000 - most


def test_another_shape_is_a_miss_sent_direct():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    send(activations(shape=(4, 24, 64)), "delta(int8)", sender, receiver)
    payload, y = send(activations(1, shape=(4, 24, 32)), "delta(int8)", sender, receiver)
    assert payload.parts[1].tolist() == [0, 0, 0, 0] and y.shape == (4, 24, 32)


@pytest.mark.parametrize("length", [18, 30])
def test_an_example_batched_to_another_padded_length_is_still_a_delta(length):
    """Batches pad to their longest sentence, so an example comes back at another length most of the
    time: a 7.3-epoch ABNet job sent 24% of its revisits as deltas when only equal shapes were."""
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations(shape=(4, 24, 64))
    x[:, 12:] = 0.5  # real tokens first, then what the encoder gives its padding
    send(x, "delta(int8)", sender, receiver)
    again = torch.full((4, length, 64), 0.5)
    again[:, :12] = drift(x[:, :12], seed=1)
    payload, y = send(again, "delta(int8)", sender, receiver)
    assert payload.parts[1].tolist() == [1, 1, 1, 1] and y.shape == (4, length, 64)
    assert torch.equal(sender["cache"].get(int(IDS[0]))[1], receiver["cache"].get(int(IDS[0]))[1])
    _, direct = send(again, "int8", CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h"))
    assert error(y[:, :12], again[:, :12]) < error(direct[:, :12], again[:, :12]) / 5


def test_a_receiver_without_the_named_base_refuses_and_changes_nothing():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations()
    send(x, "delta(int8)", sender, receiver)
    pack("h", "activation", drift(x, 1), "delta(int8)", state=sender, ids=IDS)  # message 2: lost
    before = {k: receiver["cache"].get(k) for k in IDS.tolist()}
    late = pack("h", "activation", drift(x, 2), "delta(int8)", state=sender, ids=IDS)
    with pytest.raises(CodecError, match=r"delta against the base of message 2 .* holds the base of message 1"):
        unpack(through_wire(late), state=receiver)
    assert {k: receiver["cache"].get(k) for k in IDS.tolist()} == before
    with pytest.raises(CodecError, match="holds no base"):
        unpack(through_wire(late), state=CodecState().slot("a->b", "h"))


def test_without_state_or_ids_it_says_what_to_pass():
    x = activations()
    with pytest.raises(CodecError, match=r"ids=example_ids"):
        pack("h", "activation", x, "delta(int8)", state={})
    payload = pack("h", "activation", x, "delta(int8)", state={}, ids=IDS)
    with pytest.raises(CodecError, match=r"unpack\(payload, state=...\)"):
        unpack(payload)
    with pytest.raises(CodecError, match="ids must be int64"):
        pack("h", "activation", x, "delta(int8)", state={}, ids=IDS[:3])


class RowProbe(Codec):
    """Needs the rows' ids, as `delta` does, and remembers the ones it was given (not registered)."""

    def __init__(self):
        self.seen = []

    @property
    def spec(self) -> str:
        return "probe"

    @property
    def needs_ids(self) -> bool:
        return True

    def encode(self, x, state=None, *, ids=None):
        self.seen.append(ids)
        return [x.float().clone()], {}

    def decode(self, parts, meta):
        return parts[0]


def test_ids_are_declared_and_passed_to_encode_through_wrappers():
    """The ids used to ride in the stream's state dict for `delta` to pop: now a codec says it needs
    them and gets them as encode's `ids`, through a chain or `ef` around it; the state never holds them."""
    assert parse("delta(int8)").needs_ids and not parse("ef(int8(lowrank(0.5)))").needs_ids
    probe = RowProbe()
    for codec in (probe, Chain(outer=parse("fp16"), inner=probe), ErrorFeedback(probe)):
        assert codec.needs_ids
        codec.encode(activations(), {}, ids=IDS)
        assert probe.seen.pop() is IDS
    slot = CodecState().slot("a->b", "h")
    pack("h", "activation", activations(), "delta(int8)", state=slot, ids=IDS)
    assert "ids" not in slot


@pytest.mark.parametrize("spec", ["ef(delta(int8))", "fp16(delta(int8))", "delta(delta(int8))"])
def test_delta_must_be_the_outermost_codec(spec):
    with pytest.raises(ConfigError, match="must be the outermost codec"):
        parse(spec)


def test_specs_print_canonically():
    assert parse("delta( int8(lowrank(0.5)) , mb = 1024)").spec == "delta(int8(lowrank(0.5)))"
    assert parse("delta(int8, 64)").spec == "delta(int8, mb=64)"
    assert parse("delta(int8(lowrank(0.1)),first = int8(lowrank( 0.25 )),mb=64)").spec == \
        "delta(int8(lowrank(0.1)), mb=64, first=int8(lowrank(0.25)))"
    assert parse("delta(int8, first=none)").first == parse("none")  # a bare name is a codec here
    # arguments equal to their defaults (first=inner, ram=mb) are not written: one codec, one spec, one state
    assert parse("delta(int8, first=int8)").spec == parse("delta(int8, ram=1024)").spec == "delta(int8)"
    assert parse("delta(int8(lowrank(0.5)), first=int8(lowrank(0.5), block=64), mb=8, ram=8)").spec == \
        "delta(int8(lowrank(0.5)), mb=8)"
    assert parse("delta(int8, first=int8)") == parse("delta(int8)")
    with pytest.raises(ConfigError, match="mb=0"):
        parse("delta(int8, mb=0)")


@pytest.mark.parametrize("spec, message", [
    ("delta(int8, first=delta(int8))", "must be the outermost codec"),
    ("delta(int8, first=0.5)", "'first' must be a codec such as"),
    ("delta(int8, first=nope)", "'nope' at column 19: unknown codec"),
    ("delta(int8(lowrank(0.1)), first=int)", "'int' at column 33: unknown codec"),  # not int8's column
    ("delta(int8, mb=int8)", "'mb' must be an integer, got 'int8'"),
    ("int8(block=lowrank(0.5))", "'block' must be an integer, got the codec 'lowrank'"),
    ("ef(int8, first=int8)", "unknown parameter 'first'"),
])
def test_a_bad_first_codec_is_refused_by_name(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(spec)


def test_cache_state_dicts_round_trip_through_a_checkpoint():
    sender, receiver = CodecState().slot("a->b", "h"), CodecState().slot("a->b", "h")
    x = activations()
    send(x, "delta(int8)", sender, receiver)
    restored = []
    for slot in (sender, receiver):
        buffer = io.BytesIO()
        torch.save(slot["cache"].state_dict(), buffer)
        fresh = CodecState().slot("a->b", "h")
        fresh["spec"], fresh["seq"] = slot["spec"], slot.get("seq", 0)
        fresh["cache"] = type(slot["cache"])(1)
        fresh["cache"].load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        assert fresh["cache"].stats() == slot["cache"].stats()
        restored.append(fresh)
    x2 = drift(x, 1)
    payload, y = send(x2, "delta(int8)", *restored)
    _, y_kept = send(x2, "delta(int8)", sender, receiver)
    assert payload.parts[1].tolist() == [1, 1, 1, 1] and torch.equal(y, y_kept)
