"""The reliable channel against real failures: gateway SIGKILL + restart, sender restart, a dead
peer, a dead gateway, a receiver that stops reading. Nothing accepted is lost or delivered twice."""
from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest

from nebula.errors import TransportError
from nebula.site.channel import open_channel
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor
from nebula.transport.streams import RecvStream, Verdict
from nebula.wire import decode_message, encode_message, with_base
from tests.support.gateways import FAST, REPO, tensor_message

# Survives a gateway restart (a few seconds: the process imports torch) without declaring it dead.
PATIENT = dataclasses.replace(FAST, gateway_timeout=20.0, peer_timeout=30.0)


def _send_all(channel, dst: str, count: int, errors: list, pause: float = 0.005) -> None:
    try:
        for step in range(count):
            channel.send(tensor_message(dst, step, n=1024), timeout=30)
            time.sleep(pause)
    except Exception as exc:  # reported by the test thread
        errors.append(exc)


@pytest.mark.parametrize("victim", ["b", "a"], ids=["receiver-gateway", "sender-gateway"])
def test_gateway_sigkill_mid_stream_loses_nothing_and_duplicates_nothing(world, gateways, victim):
    count, errors = 300, []
    with open_channel(world.site("a").config, "a/enc/0", config=PATIENT) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=PATIENT) as b:
        sender = threading.Thread(target=_send_all, args=(a, "b/dec/0", count, errors))
        sender.start()
        got = [b.recv(timeout=30).step for _ in range(50)]
        gateways[victim].kill()  # SIGKILL: whatever it held in its queues is gone
        time.sleep(0.3)
        gateways[victim].start()
        while len(got) < count:
            got.append(b.recv(timeout=30).step)
        sender.join(30)
        assert not errors, errors
        assert got == list(range(count))  # every message, once, in order
        assert a.flush(10)
        with pytest.raises(TransportError, match="no message"):
            b.recv(timeout=1.5)  # and nothing more: no late duplicate
        # The gateway really died mid-stream: the victim's stage lost its connection to it. Whether
        # a message was inside it at that instant (and had to be resent) is timing; the order and the
        # exactly-once checks above hold either way.
        assert (b if victim == "b" else a).stats["disconnects"] >= 1


def test_restarted_sender_starts_a_new_stream(world, gateways):
    with open_channel(world.site("b").config, "b/dec/0", config=FAST) as b:
        for incarnation in range(2):  # same address, new process state: seq restarts at 1, epoch grows
            with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a:
                for step in range(5):
                    a.send(tensor_message("b/dec/0", 10 * incarnation + step), timeout=5)
        got = [b.recv(timeout=10) for _ in range(10)]
    assert [m.step for m in got] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert [m.seq for m in got] == [1, 2, 3, 4, 5] * 2
    assert got[5].epoch > got[0].epoch


def test_stream_rules_drop_stale_and_duplicate_messages():
    """The receiver's verdicts without sockets (the cases a live test cannot force reliably)."""
    stream = RecvStream("a/enc/0")
    assert [stream.judge(100, s) for s in (1, 2, 2, 4)] == [Verdict.DELIVER, Verdict.DELIVER,
                                                             Verdict.DUPLICATE, Verdict.GAP]
    assert stream.judge(200, 3) is Verdict.GAP  # restarted sender whose first message was lost
    assert stream.judge(200, 1) is Verdict.DELIVER
    assert stream.judge(100, 3) is Verdict.STALE  # late message of the old incarnation


def test_first_contact_starts_the_stream_at_the_senders_oldest_unacked_message():
    """A receiver that has never heard of a stream takes it from `base`, the sender's oldest
    unacknowledged seq: seq 1 bounced ("unreachable": the receiver was still connecting) while seq 2
    got through must not make seq 1 look like a duplicate (it was once dropped that way, ~1 run in 5)."""
    fresh = RecvStream("a/enc/0")
    assert fresh.judge(100, 2, base=1) is Verdict.GAP  # wait for seq 1 (the receiver asks for a resend)
    assert [fresh.judge(100, s, base=1) for s in (1, 2, 3)] == [Verdict.DELIVER] * 3
    restarted = RecvStream("a/enc/0")  # this receiver restarted: messages before base were acknowledged
    assert restarted.judge(100, 7, base=7) is Verdict.DELIVER
    assert RecvStream("a/enc/0").judge(100, 7) is Verdict.DELIVER  # base unknown (0): from this message


def test_a_later_base_moves_a_restarted_receiver_past_seqs_the_sender_freed():
    """A restarted receiver whose first copy was stamped before the sender saw its predecessor's last
    ACK starts too low (base 3); once a later copy says base 6, seqs 3-5 were delivered (the sender
    frees a seq only on an ACK) and can never come again: waiting for them made every message a gap."""
    restarted = RecvStream("a/enc/0")
    assert restarted.judge(100, 6, base=3) is Verdict.GAP  # asks for 3, which the sender no longer has
    assert restarted.judge(100, 6, base=6) is Verdict.DELIVER
    assert restarted.judge(100, 5, base=6) is Verdict.DUPLICATE
    assert [restarted.judge(100, s, base=7) for s in (7, 8)] == [Verdict.DELIVER] * 2


def test_base_is_stamped_on_the_envelope_without_re_encoding_it():
    frames = encode_message(tensor_message("b/dec/0", 3))
    stamped = with_base(frames[0], 42)
    assert decode_message([stamped, *frames[1:]]).base == 42
    assert decode_message([with_base(stamped, 43), *frames[1:]]).base == 43  # the last stamp wins


def test_full_window_blocks_then_times_out_and_memory_stays_bounded(world, gateways):
    small = dataclasses.replace(FAST, window_messages=4, inbox_messages=2, resend_timeout=0.5)
    with open_channel(world.site("a").config, "a/enc/0", config=small) as a, \
            open_channel(world.site("b").config, "b/dec/0", config=small) as b:
        sent = 0
        with pytest.raises(TransportError, match="window full"):
            for step in range(100):
                a.send(tensor_message("b/dec/0", step), timeout=1.0)
                sent += 1
        assert sent <= small.window_messages + small.inbox_messages
        assert a.stats["in_flight"] <= small.window_messages
        got = [b.recv(timeout=10).step for _ in range(sent)]  # reading drains it, in order
        assert got == list(range(sent))


def test_dead_gateway_is_reported_by_name(world, gateways):
    with open_channel(world.site("a").config, "a/enc/0", config=FAST) as a:
        gateways["a"].kill()
        start = time.monotonic()
        with pytest.raises(TransportError, match="gateway a/gateway/0 has not answered"):
            a.recv(timeout=FAST.gateway_timeout + 5)
        assert time.monotonic() - start < FAST.gateway_timeout + 2


RECEIVER = """
import sys, time
from nebula.site.config import load_site_config
from nebula.site.channel import open_channel
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor
from tests.support.gateways import FAST
channel = open_channel(load_site_config(sys.argv[1]), "b/dec/0", config=FAST)
channel.recv(timeout=30)
print("ready", flush=True)
time.sleep(60)
"""


def test_dead_peer_is_reported_by_name(world, gateways, tmp_path):
    receiver = ServiceSpec(name="receiver", argv=(sys.executable, "-c", RECEIVER, str(world.site("b").config_path)),
                           run=tmp_path, ready="ready", cwd=REPO)
    with Supervisor(strict=False) as stages, open_channel(world.site("a").config, "a/enc/0", config=FAST) as a:
        stages.start(receiver)
        a.send(tensor_message("b/dec/0", 0), timeout=5)
        stages.ready("receiver", timeout=30)
        stages.kill("receiver")
        start = time.monotonic()
        with pytest.raises(TransportError, match="peer b/dec/0 has not answered"):
            while True:
                a.send(tensor_message("b/dec/0", 1), timeout=FAST.peer_timeout + 5)
        assert time.monotonic() - start < FAST.peer_timeout + 3
