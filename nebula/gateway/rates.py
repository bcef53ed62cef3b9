"""How many messages per second the gateway takes from each authenticated sender: a token bucket each.

A legitimate stage's reliable channel keeps at most `window_messages` in flight per peer, so it sends a
few to a few hundred messages a second (acks and heartbeats included); a stage that ignores its window can send
tens of thousands, and each one it gets forwarded costs an audit record, and each refusal CPU. The
gateway takes `burst` messages at once and `rate` a second after that from one sender (one
certificate, whatever its connections); beyond, it answers ERROR "rate-limited", which a channel treats
like a full next hop: it resends a little later. Stages and peer gateways have their own limits, since
a peer gateway carries all its site's stages. The sender is known before the message is parsed, so
garbage counts too.
"""
from __future__ import annotations

import time

PRUNE_AT = 4096  # buckets kept before the full (idle) ones are forgotten


class SenderRates:
    def __init__(self, rate: float, burst: int, peer_rate: float, peer_burst: int) -> None:
        self.limits = {False: (float(rate), float(burst)), True: (float(peer_rate), float(peer_burst))}
        self._buckets: dict[str, list[float]] = {}  # sender -> [tokens, time of the last refill, rate, burst]

    def take(self, sender: str, gateway: bool) -> bool:
        """Spend one message of `sender`'s allowance (`gateway`: a peer site's gateway); False when none is left."""
        now = time.monotonic()
        bucket = self._buckets.get(sender)
        if bucket is None:
            if len(self._buckets) >= PRUNE_AT:
                self._prune(now)
            rate, burst = self.limits[gateway]
            bucket = self._buckets[sender] = [burst, now, rate, burst]
        tokens, last, rate, burst = bucket
        tokens = min(burst, tokens + (now - last) * rate)
        bucket[:2] = tokens - (tokens >= 1.0), now
        return tokens >= 1.0

    def explain(self, sender: str, gateway: bool) -> str:
        rate, burst = self.limits[gateway]
        knobs = "peer_rate_limit and peer_rate_burst" if gateway else "rate_limit and rate_burst"
        return (f"{sender} sent more than {rate:g} messages/s (bursts of {burst:g}); the message was dropped: "
                f"slow down (a reliable channel resends it), or raise [gateway] {knobs}")

    def _prune(self, now: float) -> None:
        """Forget the senders whose bucket has refilled: they start full again, which is the same."""
        for sender, (tokens, last, rate, burst) in list(self._buckets.items()):
            if tokens + (now - last) * rate >= burst:
                del self._buckets[sender]
