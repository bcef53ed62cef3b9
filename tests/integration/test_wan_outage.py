"""A peer site that its own gateway cannot reach is an outage, not a dead peer (docs/runtime.md, "WAN
outages"): real gateways on loopback, the peer site's gateway SIGKILLed (what a WAN cut looks like
from this side: our gateway answers `unreachable`); and the emulated WAN's cut itself (root). Whole
jobs through a cut: tests/e2e/test_chaos.py (root)."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

from nebula.errors import FIX_FIRST, LinkDown, RecvTimeout
from nebula.site.channel import open_channel
from nebula_lab.wanem import WanError, WanLink, measure_goodput
from tests.support.gateways import FAST, tensor_message
from tests.support.wan import ROOT

# a's peers die fast, a site outage lasts longer; b outlives its own gateway's restart (the victim here)
OUTAGE = dataclasses.replace(FAST, peer_timeout=2.0, wan_timeout=60.0, gateway_timeout=30.0)
BEHIND_THE_VICTIM = dataclasses.replace(FAST, peer_timeout=60.0, gateway_timeout=60.0)


def test_an_unreachable_site_is_waited_for_past_peer_timeout_and_resent_to_when_it_returns(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=OUTAGE) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=BEHIND_THE_VICTIM) as b:
        a.send(tensor_message("b/dec/0", 0), timeout=5)
        assert b.recv(timeout=10).step == 0
        gateways["b"].kill()  # site b is gone for a's gateway, as in a WAN cut
        a.send(tensor_message("b/dec/0", 1), timeout=5)  # accepted, held unacknowledged
        with pytest.raises(RecvTimeout):  # a plain timeout: not "peer b/dec/0 has not answered"
            a.recv(timeout=2 * OUTAGE.peer_timeout)
        assert set(a.outages()) == {"b"} and a.outages()["b"] > OUTAGE.peer_timeout
        resent_before = a.stats["resent"]
        time.sleep(1.5 * OUTAGE.resend_timeout)  # a resend would have come by now
        assert a.stats["resent"] == resent_before, "resent into the outage: only pings should probe it"
        gateways["b"].start()
        assert b.recv(timeout=20).step == 1  # resent as soon as site b answered again
        assert a.flush(10) and a.outages() == {}


def test_an_unreachable_site_past_wan_timeout_stops_the_channel_with_link_down(world, gateways):
    short = dataclasses.replace(OUTAGE, wan_timeout=3.0)
    with open_channel(world.site("a").config, "a/enc/0", config=short) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=BEHIND_THE_VICTIM) as b:
        a.send(tensor_message("b/dec/0", 0), timeout=5)
        assert b.recv(timeout=10).step == 0
        gateways["b"].kill()
        started = time.monotonic()
        with pytest.raises(LinkDown) as down:
            while time.monotonic() - started < 30:
                try:
                    a.recv(timeout=1)
                except RecvTimeout:
                    continue
        assert short.wan_timeout < time.monotonic() - started < short.wan_timeout + 8
        assert "a/enc/0: site b has been unreachable for " in str(down.value)
        assert "[channel] wan_timeout 3 s" in str(down.value)
        with pytest.raises(LinkDown):
            a.send(tensor_message("b/dec/0", 1), timeout=5)  # the channel is done: the job stops
    assert isinstance(down.value, FIX_FIRST)  # `nebula stage run` exits 3: no supervisor restarts it


@pytest.mark.root
@ROOT
@pytest.mark.timeout(60)
def test_a_cut_link_loses_every_packet_without_an_error_and_restore_brings_it_back():
    with WanLink(f"nbcut{os.getpid()}", rate_mbit=20) as link:
        link.cut()
        assert link.is_cut("a") and link.is_cut("b")
        with pytest.raises(WanError, match="timed out"):  # no refusal, no unreachable network: silence
            measure_goodput(link, 100_000, timeout_s=3)
        link.restore()
        assert not link.is_cut("a") and not link.is_cut("b")
        assert measure_goodput(link, 2_000_000) > 0.9 * 20
