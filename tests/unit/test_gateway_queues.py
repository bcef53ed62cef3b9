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


def test_the_allocator_is_asked_to_give_memory_back_once_the_queues_let_go_of_enough():
    """nebula/gateway/memory.py: the real malloc_trim on this glibc, and when it is called."""
    from nebula.gateway.memory import Reclaim

    assert Reclaim().trim is not None  # glibc here: the gateway does return memory
    calls = []
    reclaim = Reclaim(threshold=10 << 20, trim=lambda: calls.append(1))
    held = [0, 4 << 20, 12 << 20, 3 << 20, 1 << 20, 30 << 20, 25 << 20, 0, 0]
    # 12 -> 3 MiB is 9 below the peak: not yet; 1 MiB is 11 below: asked; the next peak (30) counts afresh
    assert [reclaim.observe(h) for h in held] == [False, False, False, False, True, False, False, True, False]
    assert reclaim.trims == len(calls) == 2
