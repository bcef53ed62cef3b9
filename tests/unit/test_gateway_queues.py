"""What a next hop's queue counts against the gateway's budgets: a message's memory, not its bytes
alone (nebula/gateway/queues.py, issue 42, class 6). Real sockets, a receiver that does not read."""
from __future__ import annotations

import zmq

from nebula.gateway.queues import FRAME_OVERHEAD, MESSAGE_OVERHEAD, HopQueues, cost


def test_small_messages_are_charged_what_they_hold_and_the_budget_stops_them():
    frames = [b"e" * 100, b"p" * 1024]  # an envelope and one 1 KiB payload
    one = cost(frames, 1124)
    assert one == 1124 + MESSAGE_OVERHEAD + 2 * FRAME_OVERHEAD and one > 6 * 1124
    with zmq.Context() as ctx:
        receiver, sender = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)  # the receiver never reads
        receiver.bind("inproc://hop")
        sender.connect("inproc://hop")
        queues = HopQueues(per_hop=3 * one, total=10 * one)
        assert [queues.send(sender, frames, "a/stall/0", 1124) for _ in range(4)] == [True, True, True, False]
        assert queues.status() == {"a/stall/0": 3 * one}
        for sock in (receiver, sender):
            sock.close(linger=0)
