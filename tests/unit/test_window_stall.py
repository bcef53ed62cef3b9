"""Window.stalled: the go-back-N timer must outlast the oldest message's own wire time.

Measured on the emulated WAN (60 Mbit/s, RTT 200 ms, `nebula bench transport --wan-only --rtt-ms 200`):
with the timer at max(resend_timeout, 4 x ACK spacing) = 5 s before any ACK, the first 25 MB message
(3.4 s on the wire, plus TCP's start-up over several 200 ms round trips) was not acknowledged within
5 s, and the channel sent all six messages again.
"""
from __future__ import annotations

from nebula.transport.config import ChannelConfig
from nebula.transport.window import Window

MB = 1 << 20


def window_with_one_sent(nbytes: int, config: ChannelConfig | None = None) -> tuple[Window, object]:
    window = Window("a/src/0", config or ChannelConfig())
    window.push("b/dst/0", nbytes, lambda seq, epoch: [b"frame"], timeout=1)
    stream, pending = window.next_outgoing()
    window.mark_sent(stream, pending, now=100.0)
    return window, stream


def test_a_large_message_is_not_resent_before_its_wire_time_at_the_slowest_rate():
    window, stream = window_with_one_sent(25 * MB)  # 25 MB at 10 Mbit/s: 21 s
    wire_s = 25 * MB * 8 / (ChannelConfig().slowest_link_mbit * 1e6)
    assert not window.stalled(stream, now=100.0 + 6.0)
    assert not window.stalled(stream, now=100.0 + wire_s - 0.1)
    assert window.stalled(stream, now=100.0 + wire_s + 0.1)


def test_a_small_message_keeps_the_resend_timeout():
    window, stream = window_with_one_sent(1 * MB)  # 0.8 s at 10 Mbit/s: the 5 s floor rules
    assert not window.stalled(stream, now=100.0 + 4.9)
    assert window.stalled(stream, now=100.0 + 5.1)


def test_backoff_multiplies_the_wire_time_too():
    window, stream = window_with_one_sent(25 * MB, ChannelConfig(slowest_link_mbit=60.0))  # 3.5 s -> 5 s floor
    stream.backoff = 4.0
    assert not window.stalled(stream, now=100.0 + 19.9)
    assert window.stalled(stream, now=100.0 + 20.1)
