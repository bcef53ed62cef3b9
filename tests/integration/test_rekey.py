"""Sessions that rekey (issue 55, point 2): every CURVE connection of a job renews its session on a schedule
(a new handshake with fresh ephemeral keys, the certificates checked again), stage to gateway
(nebula.transport.rekey, channel_io) and gateway to gateway (nebula.gateway.peers), with nothing lost or
duplicated across the switch. Real gateway processes, real CURVE, two streams at once under load.

The target's run (30 minutes, rekeys every 60 s, >= 30 handshakes per link) is the slow test at the end;
the default suite runs the same for 12 s with a rekey every second.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from nebula.errors import AuthError, RecvTimeout, TransportError
from nebula.site.channel import open_channel
from tests.support.gateways import FAST, GatewayProcess, audit_events, make_world, tensor_message

SIZE = 16 << 10  # floats per message: 64 KiB, as a training link's small activations


def _stream(channel, dst: str, until: float, sent: list[int], errors: list, rate: float | None) -> None:
    """Send numbered messages to `dst` until `until`, as fast as the window lets it or `rate` a second."""
    try:
        step, start = 0, time.monotonic()
        while time.monotonic() < until:
            channel.send(tensor_message(dst, step, n=SIZE), timeout=60)
            sent.append(step)
            step += 1
            if rate is not None:
                time.sleep(max(0.0, start + step / rate - time.monotonic()))
    except Exception as exc:  # reported by the test thread
        errors.append(exc)


def _collect(channel, expected: list[int], done: threading.Event, got: list[int], errors: list) -> None:
    try:
        while not (done.is_set() and len(got) >= len(expected)):
            try:
                got.append(channel.recv(timeout=1.0).step)
            except TransportError as exc:
                if "no message" not in str(exc):
                    raise
    except Exception as exc:
        errors.append(exc)


def rekeys_under_load(tmp_path, seconds: float, interval: float, rate: float | None = None) -> dict:
    """Two stages stream to each other through two gateways for `seconds` (`rate` messages a second each
    way, or as fast as they can), every session renewed every `interval` s; -> what each stage received
    and sent, the channels' counters, the gateways' sessions."""
    world = make_world(tmp_path, gateway={"rekey_interval": interval})
    gateways = {name: GatewayProcess(site).start() for name, site in world.sites.items()}
    config = dataclasses.replace(FAST, rekey_interval=interval, peer_timeout=10.0, gateway_timeout=6.0)
    try:
        with open_channel(world.site("a").config, "a/enc/0", config=config) as a, \
                open_channel(world.site("b").config, "b/dec/0", config=config) as b:
            until, done, errors = time.monotonic() + seconds, threading.Event(), []
            sent: dict[str, list[int]] = {"a": [], "b": []}
            got: dict[str, list[int]] = {"a": [], "b": []}
            threads = [threading.Thread(target=_stream, args=(a, "b/dec/0", until, sent["a"], errors, rate)),
                       threading.Thread(target=_stream, args=(b, "a/enc/0", until, sent["b"], errors, rate)),
                       threading.Thread(target=_collect, args=(b, sent["a"], done, got["b"], errors)),
                       threading.Thread(target=_collect, args=(a, sent["b"], done, got["a"], errors))]
            for thread in threads:
                thread.start()
            for thread in threads[:2]:
                thread.join(seconds + 120)
            done.set()
            for thread in threads[2:]:
                thread.join(120)
            assert not errors, errors
            assert a.flush(30) and b.flush(30)
            with pytest.raises(TransportError, match="no message"):
                b.recv(timeout=1.5)  # nothing more: no late duplicate
            channels = {"a": a.stats, "b": b.stats}
    finally:
        for gateway in gateways.values():
            gateway.terminate()  # SIGTERM: each writes its counters in `gateway.stopped`
    stopped = {name: audit_events(site.config.audit, "gateway.stopped")[-1]["stats"]
               for name, site in world.sites.items()}
    return {"sent": sent, "got": got, "channels": channels, "sessions": {n: s["sessions"] for n, s in stopped.items()}}


def _check(result: dict, seconds: float, interval: float) -> None:
    sent, got = result["sent"], result["got"]
    assert got["b"] == sent["a"] == list(range(len(sent["a"])))  # a -> b: every message, once, in order
    assert got["a"] == sent["b"] == list(range(len(sent["b"])))  # b -> a
    least = int(seconds / interval) - 1  # the first session, then one per interval (a little late each)
    for name, stats in result["channels"].items():
        assert stats["handshakes"] >= least and stats["rekeys"] >= least - 1, (name, stats)
    for name, other, stage in (("a", "b", "a/enc/0"), ("b", "a", "b/dec/0")):
        sessions = result["sessions"][name]
        assert sessions["out"][other] >= least, (name, sessions)  # this gateway's link to the other site
        assert sessions["in"][stage] >= least, (name, sessions)  # its stage's channel
        assert sessions["in"][f"{other}/gateway/0"] >= least, (name, sessions)  # the other gateway's link


def test_sessions_rekey_every_second_under_load_and_nothing_is_lost_or_duplicated(tmp_path):
    seconds, interval = 12.0, 1.0
    result = rekeys_under_load(tmp_path, seconds, interval)
    _check(result, seconds, interval)
    assert min(len(result["sent"]["a"]), len(result["sent"]["b"])) > 200  # it was under load throughout


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_thirty_minutes_of_rekeys_every_minute_lose_and_duplicate_nothing(tmp_path):
    """The target of issue 55: 30 minutes (and half a minute for the last rekey's timing) with a rekey
    every 60 s under load (100 messages of 64 KiB a second each way, 13 MB/s through both gateways: the
    shared machine's cores stay usable): 0 lost, 0 duplicated, >= 30 handshakes per link counted."""
    seconds, interval = 1830.0, 60.0
    result = rekeys_under_load(tmp_path, seconds, interval, rate=100.0)
    _check(result, seconds, interval)
    for name, stats in result["channels"].items():
        assert stats["handshakes"] >= 30, (name, stats)
    for name, sessions in result["sessions"].items():
        assert min(sessions["out"].values()) >= 30 and min(sessions["in"].values()) >= 30, (name, sessions)
    print({"messages": {k: len(v) for k, v in result["sent"].items()}, "channels": result["channels"],
           "sessions": result["sessions"]})


def test_a_revoked_gateway_certificate_fails_its_stages_at_their_next_rekey(tmp_path, running):
    """A stage checks its gateway's certificate again at each new session: revoked, the channel fails with
    the reason, within one rekey interval (before, a stage talked to a revoked gateway for as long as
    its connection lasted)."""
    world = make_world(tmp_path)
    running(world, "a", "b")
    a = world.site("a")
    with open_channel(a.config, "a/enc/0", config=dataclasses.replace(FAST, rekey_interval=1.0)) as channel:
        time.sleep(2.5)  # sessions renew while the certificate is good
        assert channel.stats["handshakes"] >= 2
        gateway = max((c for c in a.store.certificates() if c.address == "a/gateway/0"), key=lambda c: c.not_after)
        a.store.revoke(gateway.serial)
        world.publish()
        revoked = time.monotonic()
        with pytest.raises(AuthError, match=r"at its scheduled rekey: .*revoked"):
            while time.monotonic() - revoked < 5:
                try:
                    channel.recv(timeout=0.2)
                except RecvTimeout:
                    pass
        assert time.monotonic() - revoked < 2.5  # one interval, and the time to notice
