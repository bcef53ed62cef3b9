"""Which ERROR from a gateway is a refusal of this channel's own message: policy, apart from the I/O loop.

A gateway answers a message it will not forward with an ERROR naming the message: `topic` its
destination, `seq` and `epoch` its sequence number and its sender's incarnation (nebula/gateway/server.py,
`_refuse`). A channel's own gateway sees everything the channel sends (acks and pings too), and the
channel pinned its key: its refusals are taken as they come. A peer site's gateway only ever sees what
crosses into its own site, and a compromised one can write an ERROR naming any stage of ours, unprompted
(issue 42, class 3): so its refusal counts only for a message to its site that is in flight now, of this
channel's incarnation. Anything else is dropped and counted; refusals of acks and pings (seq 0, never in
flight) are dropped too, which costs nothing: acks are cumulative, pings repeat, and a peer gateway that
refuses everything also refuses the data that is in flight.
"""
from __future__ import annotations

from nebula.wire import Message

# Codes a channel retries after (the destination or a hop is busy or down for now); any other fails it.
TRANSIENT = ("unreachable", "rate-limited", "audit-unavailable")


def stray_refusal(refusal: Message, own_gateway: str, in_flight: bool) -> str | None:
    """Why `refusal`, an ERROR from a gateway address the channel knows, refuses nothing this channel
    has in flight through that gateway (None: it does). `in_flight`: the channel holds an unacknowledged
    message to `refusal.topic` with `refusal.seq`, in its epoch `refusal.epoch`."""
    if refusal.src == own_gateway:
        return None
    if _site(refusal.topic) != _site(refusal.src):
        return (f"{refusal.src} refused a message to {refusal.topic!r}, which is not of its site: a gateway "
                "only refuses what enters its own site")
    if not in_flight:
        return (f"{refusal.src} refused seq {refusal.seq} (epoch {refusal.epoch}) to {refusal.topic}, which is "
                "not a message this channel has in flight")
    return None


def _site(address: str) -> str:
    return address.split("/", 1)[0]
