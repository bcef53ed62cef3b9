"""The goodput `auto` compression goes by, measured by a real channel through two real gateways
(CURVE over loopback): from the ACKs of its own messages and its heartbeats' round trips."""
from __future__ import annotations

import time

from nebula.site.channel import open_channel
from nebula.transport.goodput import SAMPLES
from tests.support.gateways import FAST, tensor_message, wait_for


def test_a_channel_measures_the_goodput_and_round_trip_of_the_path_to_a_peer(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        assert a.goodput("b/dec/0") is None  # nothing sent yet
        for step in range(20):  # 20 x 4 MB
            a.send(tensor_message("b/dec/0", step, n=1 << 20), timeout=30)
        got = [b.recv(timeout=30).step for _ in range(20)]
        assert got == list(range(20)) and a.flush(10)
        wait_for(lambda: a.goodput("b/dec/0").rtt_s is not None, timeout=5, what="a heartbeat's round trip")
        time.sleep(1.0)  # a few idle pings: the least round trip is the propagation (here: processing)
        measured = a.goodput("b/dec/0")
        # the last 16 ACKs at most; one cumulative ACK may free several messages (12 ACKs for 20 on a loaded host)
        assert 2 <= measured.samples <= SAMPLES
        assert 0 < measured.rtt_s < 0.05
        # loopback through two gateways and CURVE: far above any WAN link, and finite
        assert measured.bytes_per_s is None or measured.bytes_per_s > 10e6
        assert b.goodput("a/enc/0") is None  # b never sent to a: no path measured
