"""The phases of a session switch without sockets (nebula.transport.rekey): when a new session is due,
what ends each phase, and what a phase that outlives its time does."""
from __future__ import annotations

from nebula.transport.rekey import Phase, Rekey


def _rekey(**kw) -> Rekey:
    return Rekey(**{"interval": 60.0, "max_bytes": 1000, "phase_timeout": 5.0, "started": 0.0, **kw})


def test_a_session_is_renewed_after_its_interval_or_its_bytes_whichever_comes_first():
    by_time = _rekey()
    assert not by_time.due(59.9) and by_time.due(60.0)
    by_bytes = _rekey()
    by_bytes.carried(999)
    assert not by_bytes.due(1.0)
    by_bytes.carried(1)
    assert by_bytes.due(1.0)


def test_a_switch_goes_through_its_phases_on_the_gateways_markers_only():
    rekey = _rekey()
    rekey.carried(5000)
    rekey.dialing(61.0)
    assert rekey.phase is Phase.DIALING and not rekey.due(62.0) and not rekey.holds_data
    token = rekey.handshaken(61.5)
    assert rekey.phase is Phase.QUIESCING and rekey.holds_data and rekey.counts["handshakes"] == 2
    assert not rekey.echoed(token + 1, 61.6)  # not our marker's echo
    assert not rekey.moved(61.6)  # "moved" before the switch: not ours either
    assert rekey.echoed(token, 61.7) and rekey.phase is Phase.DRAINING and not rekey.holds_data
    assert rekey.bytes == 0  # the new session carries from the switch on
    assert rekey.moved(61.8) and rekey.phase is Phase.STEADY and rekey.counts["rekeys"] == 1
    assert not rekey.due(61.5 + 59.9) and rekey.due(61.5 + 60.0)  # the interval runs from the new handshake


def test_a_phase_that_outlives_its_time_ends_anyway_and_says_so():
    rekey = _rekey()
    rekey.dialing(60.0)
    assert rekey.overdue(64.9) is None and rekey.overdue(65.0) is Phase.DIALING
    rekey.dial_failed(65.0)  # no handshake: the old session stays, a new dial after phase_timeout
    assert rekey.phase is Phase.STEADY and not rekey.due(69.9) and rekey.due(70.0)
    assert rekey.counts["rekey_dials_failed"] == 1
    rekey.dialing(70.0)
    rekey.handshaken(70.5)
    assert rekey.overdue(75.5) is Phase.QUIESCING  # no echo: switch anyway, resend what is unacknowledged
    rekey.forced(75.5)
    assert rekey.phase is Phase.DRAINING and rekey.overdue(80.5) is Phase.DRAINING
    rekey.forced(80.5)
    assert rekey.phase is Phase.STEADY and rekey.counts == {"handshakes": 2, "rekeys": 1, "rekeys_forced": 2,
                                                            "rekey_dials_failed": 1}
