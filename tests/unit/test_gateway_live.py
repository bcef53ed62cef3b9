"""A stage's address is bound to the connection that proved it, and only while it lasts
(nebula/gateway/live.py, issue 42, class 2)."""
from __future__ import annotations

from nebula.gateway.live import Credential, LiveConnections

ENC = Credential("a/enc/0", serial=7, issuer="ca-a", not_after=2**40)
MATE = Credential("a/mate/0", serial=8, issuer="ca-a", not_after=2**40)


def test_a_binding_ends_with_its_connection_and_only_its_own():
    live = LiveConnections()
    assert live.bind(b"a/enc/0#1", 15, ENC) and live.bind(b"a/mate/0#2", 16, MATE)
    assert live.disconnected(15) == [ENC]  # whoever presents a/enc/0#1 next is sent nothing ...
    assert "a/enc/0" not in live.stages and live.stages["a/mate/0"].connection == 16
    assert live.disconnected(15) == [] and live.disconnected(99) == []


def test_the_same_id_on_a_new_connection_is_a_new_binding_worth_a_record():
    live = LiveConnections()
    assert live.bind(b"a/enc/0#1", 15, ENC)
    assert not live.bind(b"a/enc/0#1", 15, ENC)  # the same connection speaking again
    live.disconnected(15)
    assert live.bind(b"a/enc/0#1", 17, ENC)  # ... until it proves the address again, on its new connection
    assert live.stages["a/enc/0"].connection == 17
