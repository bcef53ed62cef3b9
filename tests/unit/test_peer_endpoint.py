"""The gateway says when a peer's endpoint does not resolve (ZeroMQ retries such a name without a word)."""
from nebula.gateway.peers import unresolved


def test_a_name_that_does_not_resolve_is_named_with_the_resolver_s_reason():
    assert unresolved("tcp://site-b.invalid:5700")  # .invalid never resolves (RFC 2606)


def test_addresses_and_other_transports_pass():
    assert unresolved("tcp://127.0.0.1:5700") is None
    assert unresolved("tcp://[::1]:5700") is None
    assert unresolved("ipc:///run/nebula/gateway") is None
