"""The policy of which gateway ERROR refuses a message of this channel (nebula/transport/refusals.py)."""
from __future__ import annotations

from nebula.transport.refusals import stray_refusal
from nebula.wire import Kind, Message


def refusal(src: str, topic: str, seq: int = 3) -> Message:
    return Message(kind=Kind.ERROR, src=src, dst="a/enc/0", topic=topic, seq=seq, epoch=11, error_code="auth")


def test_the_own_gateways_refusals_count_as_they_come():
    assert stray_refusal(refusal("a/gateway/0", "b/dec/0", seq=0), "a/gateway/0", in_flight=False) is None


def test_a_peer_gateway_refuses_only_a_message_in_flight_into_its_own_site():
    assert stray_refusal(refusal("b/gateway/0", "b/dec/0"), "a/gateway/0", in_flight=True) is None
    assert "not a message this channel has in flight" in stray_refusal(
        refusal("b/gateway/0", "b/dec/0"), "a/gateway/0", in_flight=False)
    # in flight, but to site c: b's gateway never saw it
    assert "not of its site" in stray_refusal(refusal("b/gateway/0", "c/dec/0"), "a/gateway/0", in_flight=True)
    assert "not of its site" in stray_refusal(refusal("b/gateway/0", "a/mate/0"), "a/gateway/0", in_flight=True)
