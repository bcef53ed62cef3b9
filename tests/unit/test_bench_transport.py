"""The WAN row's kept rate: what the channel sustains once its connection is up, from arrival times."""
import pytest

from nebula_lab.bench.transport import kept_rate

MB = 1 << 20


def test_a_late_first_message_and_a_constant_pipeline_delay_do_not_count():
    # 25 MB every 3.5 s (60 Mbit/s) behind a 0.7 s pipeline; the first held back by loss recovery
    arrived = [7.9] + [0.7 + 3.5 * k for k in range(2, 9)]
    assert kept_rate(25 * MB, arrived) == pytest.approx(25 * MB / 3.5)


def test_noise_in_the_arrivals_averages_out_rather_than_the_last_gap_deciding():
    arrived = [5.0, 9.0, 12.4, 16.1, 19.4, 23.1, 27.3]  # gaps 3.4-4.2 s around 3.65
    rate = kept_rate(10 * MB, arrived)
    assert 10 * MB / 3.8 < rate < 10 * MB / 3.5


def test_two_messages_cannot_tell_a_rate():
    assert kept_rate(MB, [1.0, 2.0]) is None
