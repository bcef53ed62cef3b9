"""DelayLine: the same packets out, in order, exactly `delay_s` later; bounded."""
from __future__ import annotations

from nebula_lab.delayline import DelayLine


def test_packets_come_out_in_order_after_the_delay():
    line = DelayLine(delay_s=0.1)
    line.push(b"one", now=1.0)
    line.push(b"two", now=1.05)
    assert line.due(1.099) == []
    assert abs(line.wait_s(1.099) - 0.001) < 1e-9
    assert line.due(1.1) == [b"one"]
    assert line.due(1.2) == [b"two"]
    assert line.wait_s(1.2) is None and line.held_bytes == 0


def test_beyond_the_bound_packets_are_dropped_and_counted():
    line = DelayLine(delay_s=0.1, max_bytes=5)
    line.push(b"abc", now=0.0)
    line.push(b"def", now=0.0)  # 6 bytes > 5
    assert (line.dropped, line.held_bytes) == (1, 3)
    assert line.due(1.0) == [b"abc"]
