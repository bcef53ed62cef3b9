"""How soon a gateway dials again a peer that refused its handshake (nebula/gateway/peers.py)."""
from __future__ import annotations

from nebula.gateway.peers import REDIAL_MAX, redial_delay


def test_a_refused_link_is_dialled_again_soon_then_every_few_seconds():
    assert [redial_delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert redial_delay(10_000) == REDIAL_MAX  # never longer, however long the peer refuses
