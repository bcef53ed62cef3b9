"""Messages a peer stage can send, well-formed on the wire, that once crashed a stage with a foreign
exception, were buffered without bound, or were applied silently twice (found by review): each now
stops the stage with a StageError naming what is wrong (docs/runtime.md, "Failures")."""
from __future__ import annotations

import json
import time

import pytest
import torch

from nebula.codecs import pack
from nebula.errors import StageError
from nebula.runtime import control as ctl
from nebula.runtime import generations as generations_module
from nebula.runtime.job_digest import JobDefinition
from nebula.runtime.order import id_hashes
from nebula.transport.inproc import InProcHub
from nebula.wire import Kind, Message
from tests.support.runtime import Running, example_job

SRC, SINK = "a/src/0", "b/sink/0"


def definition(running) -> dict:
    """The job definition fields of a HELLO or RESYNC for the job `running` runs (a peer of the same job)."""
    job = JobDefinition.of(running.job)
    return {"job": job.digest, "job_keys": job.keys}


def control(body, generation: int, dst: str = SINK, step: int = 0) -> Message:
    msg = ctl.control(body, "t", dst, generation)
    msg.step = step
    return msg


def joined_sink(tmp_path):
    """The example job's sink in a thread, brought into generation 1 at step 0 by this test, which
    plays its source (the coordinator)."""
    running = Running(example_job(steps=2), tmp_path, InProcHub())
    src = running.hub.channel(SRC)
    running.start("sink")
    src.send(control(ctl.Resync(round=1, **definition(running)), 0))
    src.send(control(ctl.Resume(round=1, step=0, generation=1), 0))
    while True:
        msg = src.recv(timeout=20)
        if msg.kind == Kind.CONTROL and ctl.parse_control(msg)[0] is ctl.Topic.READY:
            return running, src


def forward(step: int, micro_batch: int, topic: str = "fwd", rows=(0, 1, 2, 3)) -> Message:
    ids = id_hashes([f"train:{r}" for r in rows])
    return Message(kind=Kind.TENSORS, job="t", dst=SINK, step=step, micro_batch=micro_batch, generation=1, topic=topic,
                   tensors=[pack("hidden", "activation", torch.randn(len(rows), 16), "none"),
                            pack("example_ids", "ids", ids, "none")])


def stopped_with(running, name: str) -> StageError:
    running.threads[name].join(20)
    error = running.errors.get(name)
    assert isinstance(error, StageError), repr(error)
    return error


@pytest.mark.parametrize("send, says", [
    (lambda src: src.send(Message(kind=Kind.CONTROL, job="t", dst=SINK, generation=1, topic="pace",
                                  body=b"[" * 50_000)),
     "the body is not JSON"),  # a RecursionError in json.loads
    (lambda src: src.send(control(ctl.InferEnd(origin="nosuch", split="test"), 1)), "'nosuch', which is no stage"),
    (lambda src: src.send(forward(0, 0, topic="infer:nosuch:test")), "'nosuch', which is no stage"),  # KeyError
    (lambda src: src.send(forward(10 ** 9, 0, topic="infer:src:test")), "at step 1000000000; the job has 2"),
    (lambda src: [src.send(forward(step, 0)) for step in range(1000, 1300)], "takes steps up to 2"),
    (lambda src: [src.send(forward(1, 1, rows=rows)) for rows in ((4, 5, 6, 7), (8, 9, 10, 11))], "twice"),
])
def test_a_bad_message_from_a_peer_stops_the_stage_saying_what_is_wrong(tmp_path, send, says):
    running, src = joined_sink(tmp_path)
    send(src)
    assert says in str(stopped_with(running, "sink"))
    assert len(running.runners["sink"].board.open) <= 1  # nothing of a run far ahead was kept


def test_a_micro_batch_sent_again_after_it_ran_is_refused(tmp_path):
    running, src = joined_sink(tmp_path)
    src.send(forward(1, 0))
    runner = running.runners["sink"]
    deadline = time.monotonic() + 20
    while (runner.board.open.get(1) is None or runner.board.open[1].forwarded < 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    src.send(forward(1, 0))  # it ran already: a second copy would have been parked and never used
    assert "twice" in str(stopped_with(running, "sink"))


def test_a_generation_no_message_can_carry_is_refused_where_it_is_heard(tmp_path):
    running = Running(example_job(steps=2), tmp_path, InProcHub())
    src = running.hub.channel(SRC)
    running.start("sink")
    src.send(control(ctl.Resync(round=1, **definition(running)), 0))
    src.send(control(ctl.Resume(round=1, step=0, generation=2 ** 64), 0))  # READY could not be encoded
    started = time.monotonic()
    assert "generation" in str(stopped_with(running, "sink"))
    assert time.monotonic() - started < 10  # at once, not after the receive timeout


def test_gradients_sent_twice_are_refused(tmp_path):
    running = Running(example_job(steps=2), tmp_path, InProcHub())
    sink = running.hub.channel(SINK)
    running.start("src")
    while True:  # answer the coordinator's RESYNC, then its RESUME
        msg = sink.recv(timeout=20)
        if msg.kind != Kind.CONTROL:
            continue
        topic, body = ctl.parse_control(msg)
        if topic is ctl.Topic.RESYNC:
            sink.send(control(ctl.Hello(incarnation=1, checkpoints=(0,), generation=0, answer_to=body.round,
                                        **definition(running)), 0, dst=SRC))
        elif topic is ctl.Topic.RESUME:
            generation = body.generation
            sink.send(control(ctl.Ready(round=body.round, step=body.step), generation, dst=SRC))
            break
    while sink.recv(timeout=20).kind != Kind.TENSORS:
        pass  # the first micro-batch of step 1

    def gradient(value: float) -> Message:
        return Message(kind=Kind.TENSORS, job="t", dst=SRC, step=1, micro_batch=0, generation=generation, topic="bwd",
                       tensors=[pack("hidden", "gradient", torch.full((4, 16), value), "none")])
    sink.send(gradient(1.0))
    sink.send(gradient(1000.0))
    assert "twice" in str(stopped_with(running, "src"))


def test_a_resume_into_a_generation_already_abandoned_is_refused(tmp_path):
    """Once refused nothing: the sink resumed into generation 1 again and dropped every message of it
    as abandoned work until its receive timeout, silent."""
    running, src = joined_sink(tmp_path)
    src.send(control(ctl.Resync(round=2, **definition(running)), 1))
    src.send(control(ctl.Resume(round=2, step=0, generation=1), 1))
    started = time.monotonic()
    assert "into generation 1, below 2" in str(stopped_with(running, "sink"))
    assert time.monotonic() - started < 10


def test_messages_of_a_generation_not_yet_entered_are_kept_within_a_bound(tmp_path, monkeypatch):
    """They were kept without bound: a peer in a newer generation could fill the memory of a stage
    that had not resumed into it yet."""
    monkeypatch.setattr(generations_module, "LATER_BYTES", 64 << 10)
    running, src = joined_sink(tmp_path)
    ahead = forward(1, 0)
    ahead.generation = 2
    for _ in range(200):  # (4, 16) float32 + ids: ~300 bytes each, ~60 KB in all: kept
        src.send(ahead)
    ahead.tensors[0] = pack("hidden", "activation", torch.randn(4, 4096), "none")
    for _ in range(2):  # 64 KB each: the second passes the bound
        src.send(ahead)
    error = str(stopped_with(running, "sink"))
    assert "generation 2 while sink is in 1" in error and "flooding" in error
    assert running.runners["sink"].generations.later_bytes <= 64 << 10


@pytest.mark.parametrize("topic, body, says", [
    ("infer-end", {"origin": "src", "split": "../../escape"}, "split '../../escape'"),  # it names the sink's files
    ("infer-end", {"origin": "a b", "split": "test"}, "origin 'a b'"),
    ("infer-progress", {"split": "a/b", "n": 1}, "split 'a/b'"),
    ("scores", {"split": "", "sink": "sink"}, "split ''"),
])
def test_a_split_or_stage_name_that_is_no_name_is_refused(tmp_path, topic, body, says):
    running, src = joined_sink(tmp_path)
    src.send(Message(kind=Kind.CONTROL, job="t", dst=SINK, generation=1, topic=topic, body=json.dumps(body).encode()))
    assert says in str(stopped_with(running, "sink"))
    assert not list(tmp_path.parent.rglob("escape*"))
