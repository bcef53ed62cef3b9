"""The runtime's protocol pieces on their own: typed control messages, the coordinator's state
machine, the check of what arrives against the declared ports, and the background sender."""
import threading

import pytest
import torch

from nebula.errors import DataError, RemoteError, StageError
from nebula.runtime import control as ctl
from nebula.runtime.coordinator import Coordination, Phase
from nebula.runtime.sender import BackgroundSender
from nebula.transport.inproc import InProcHub
from nebula.wire import Kind, Message
from tests.support.runtime import Running, example_job


def roundtrip(body):
    msg = ctl.control(body, "job", "b/x/0", generation=3)
    msg.src = "a/y/0"
    return ctl.parse_control(msg)


def test_every_control_topic_round_trips_typed():
    keys = {"train.steps": "8", "stages.sink.width": "16"}
    bodies = [ctl.Hello(incarnation=7, checkpoints=(0, 3), generation=2, answer_to=1, job="d" * 64, job_keys=keys),
              ctl.Resync(round=2, job="d" * 64, job_keys=keys),
              ctl.Resume(round=2, step=3, generation=4), ctl.Ready(round=2, step=3), ctl.Pace(step=5),
              ctl.InferEnd(origin="src", split="test"), ctl.InferProgress(split="test", n=8),
              ctl.Scores(split="test", sink="sink", scores={"bleu": 1.5}), ctl.Ended(step=9),
              ctl.Finish(step=9), ctl.Done(step=9), ctl.Abort(step=9, reason="a NaN"),
              ctl.Resume(round=3, step=6, generation=5, skip=(7, 9))]
    assert {type(b) for b in bodies} == set(ctl.BODIES.values())  # every topic is covered here
    for body in bodies:
        assert roundtrip(body) == (ctl.TOPICS[type(body)], body)


@pytest.mark.parametrize("topic, body, message", [
    ("hello?", b"{}", r"a/y/0 sent an unknown control topic 'hello\?'"),
    ("pace", b"[1]", r"control 'pace' from a/y/0: expected a table"),
    ("pace", b'{"step": "5"}', r"control 'pace' from a/y/0.step: expected an integer, got '5'"),
    ("pace", b'{"step": 5, "extra": 1}', "unknown key 'extra'"),
    ("resume", b'{"round": 1}', "`step` is required"),
    ("pace", b"not json", "the body is not JSON"),
])
def test_malformed_control_messages_are_errors_naming_the_sender(topic, body, message):
    msg = Message(kind=Kind.CONTROL, src="a/y/0", topic=topic, body=body)
    with pytest.raises(StageError, match=message):
        ctl.parse_control(msg)


@pytest.mark.parametrize("topic, message", [("infer:x", "expected infer:ORIGIN:SPLIT"), ("fwd:1", "takes no arguments"),
                                            ("grad", "unknown topic 'grad'")])
def test_malformed_data_topics_are_errors(topic, message):
    with pytest.raises(StageError, match=message):
        ctl.parse_data_topic(Message(kind=Kind.TENSORS, src="a/y/0", topic=topic))


def hello(incarnation, checkpoints=(0,), generation=0, answer_to=0):
    return ctl.Hello(incarnation=incarnation, checkpoints=tuple(checkpoints), generation=generation,
                     answer_to=answer_to, job="", job_keys={})


def test_coordinator_agrees_on_the_last_common_checkpoint_and_a_new_generation():
    coord = Coordination(["b", "c"])
    round_ = coord.start_round()
    assert not coord.on_hello("b", hello(1, (0, 3, 6), generation=2, answer_to=round_))
    assert not coord.all_answered()
    assert not coord.on_hello("c", hello(2, (0, 3), generation=1))  # sent on its start: counts too
    assert coord.all_answered()
    assert coord.decide(hello(9, (0, 3, 6), generation=2)) == (3, 3)
    coord.on_ready("b", ctl.Ready(round=round_, step=3))
    coord.on_ready("c", ctl.Ready(round=round_ - 1, step=3))  # an older round's: ignored
    assert not coord.all_ready()
    coord.on_ready("c", ctl.Ready(round=round_, step=3))
    assert coord.all_ready()
    coord.resumed()
    assert coord.phase is Phase.TRAINING


def test_a_restarted_member_starts_a_new_round_and_old_news_does_not():
    coord = Coordination(["b"])
    coord.start_round()
    coord.on_hello("b", hello(1))
    coord.decide(hello(9))
    assert not coord.on_hello("b", hello(1, answer_to=1))  # a late duplicate of the same process
    assert coord.on_hello("b", hello(2))  # a new process: resync everyone
    round_ = coord.start_round()
    assert not coord.on_hello("b", hello(1, answer_to=round_ - 1))  # an older round's answer: ignored
    assert not coord.all_answered()


def test_no_common_checkpoint_says_who_holds_what():
    coord = Coordination(["b"])
    coord.start_round()
    coord.on_hello("b", hello(1, (5,)))
    with pytest.raises(StageError, match=r"no checkpoint step is held by every stage.*b: \[5\]"):
        coord.decide(hello(9, (0, 3)))


def test_tensors_that_break_the_receivers_ports_are_refused_and_reported(tmp_path):
    """A message whose `hidden` is int64 arrives at the sink: it stops with a DataError naming the
    sender, link, tensor and port, and tells the sender, which stops with RemoteError."""
    job = example_job(steps=2)
    running = Running(job, tmp_path, InProcHub())
    src = running.hub.channel("a/src/0")
    running.start("sink")
    src.send(Message(kind=Kind.CONTROL, job="t", dst="b/sink/0", **_as(ctl.Resync(round=1, **_definition(job)))))
    reply = src.recv(timeout=20)  # the sink's hello
    assert ctl.parse_control(reply)[0] is ctl.Topic.HELLO
    src.send(Message(kind=Kind.CONTROL, job="t", dst="b/sink/0", generation=0,
                     **_as(ctl.Resume(round=1, step=0, generation=1))))
    from nebula.codecs import pack
    bad = [pack("hidden", "activation", torch.ones(4, 16, dtype=torch.int64), "none"),
           pack("example_ids", "ids", torch.arange(4), "none")]
    src.send(Message(kind=Kind.TENSORS, job="t", dst="b/sink/0", step=1, micro_batch=0, generation=1, topic="fwd",
                     tensors=bad))
    running.threads["sink"].join(20)
    error = running.errors["sink"]
    assert isinstance(error, DataError)
    assert "a/src/0 sent step 1 on link src->sink: 'hidden' with dtype int64, expected float" in str(error)
    while (msg := src.recv(timeout=20)).kind != Kind.ERROR:
        pass
    assert "DataError: a/src/0 sent step 1 on link src->sink: 'hidden'" in msg.error_message


def _definition(job) -> dict:
    """The job definition fields of a RESYNC from a coordinator of the same job."""
    from nebula.runtime.job_digest import JobDefinition
    definition = JobDefinition.of(job)
    return {"job": definition.digest, "job_keys": definition.keys}


def _as(body):
    msg = ctl.control(body, "t", "", 0)
    return {"topic": msg.topic, "body": msg.body}


class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, msg, timeout=None):
        self.sent.append(msg)


def test_an_exception_in_the_sender_thread_surfaces_and_flush_does_not_hang():
    """A build that fails is the stage's own failure (StageError: not restarted, its peers are told), not the
    link's: as a TransportError it made the `fp16` NaN of issue 55 a restart loop."""
    sender = BackgroundSender(_Channel(), timeout=5)
    sender.submit(lambda: Message(kind=Kind.CONTROL, topic="x"))

    def broken():
        raise TypeError("unsupported operand")
    sender.submit(broken)
    done = threading.Event()
    errors = []

    def flush():
        try:
            sender.flush()
        except StageError as exc:
            errors.append(exc)
        done.set()
    threading.Thread(target=flush, daemon=True).start()
    assert done.wait(5), "flush() hung after the sender thread failed"
    assert "a message could not be built for sending: TypeError: unsupported operand" in str(errors[0])
    with pytest.raises(StageError, match="TypeError"):
        sender.submit(lambda: Message(kind=Kind.CONTROL))
    sender.close()


def test_discard_drops_unbuilt_messages_and_settle_waits_for_builds():
    channel = _Channel()
    sender = BackgroundSender(channel, timeout=5)
    building, gate = threading.Event(), threading.Event()

    def first():
        building.set()
        gate.wait(5)
        return Message(kind=Kind.CONTROL, topic="first")
    sender.submit(first)
    assert building.wait(5)  # the sender thread is inside the first build
    for i in range(3):
        sender.submit(lambda i=i: Message(kind=Kind.CONTROL, topic=f"dropped{i}"))
    threading.Timer(0.2, gate.set).start()
    sender.discard()
    sender.submit(lambda: Message(kind=Kind.CONTROL, topic="after"))
    sender.settle()
    sender.flush()
    assert [m.topic for m in channel.sent] == ["first", "after"]
    sender.close()


def test_remote_error_names_the_failed_stage(tmp_path):
    job = example_job(steps=2)
    running = Running(job, tmp_path, InProcHub())
    src = running.hub.channel("a/src/0")
    running.start("sink")
    src.send(Message(kind=Kind.ERROR, dst="b/sink/0", error_code="stage", error_message="ValueError: boom"))
    running.threads["sink"].join(20)
    assert isinstance(running.errors["sink"], RemoteError)
    assert "a/src/0 failed: ValueError: boom" in str(running.errors["sink"])


def test_a_control_message_a_stage_does_not_expect_is_an_error(tmp_path):
    """ENDED goes to the coordinator only: sent to the sink it stops the sink, naming it."""
    job = example_job(steps=2)
    running = Running(job, tmp_path, InProcHub())
    src = running.hub.channel("a/src/0")
    running.start("sink")
    src.send(Message(kind=Kind.CONTROL, job="t", dst="b/sink/0", **_as(ctl.Resync(round=1, **_definition(job)))))
    src.recv(timeout=20)
    src.send(Message(kind=Kind.CONTROL, job="t", dst="b/sink/0", **_as(ctl.Resume(round=1, step=0, generation=1))))
    src.send(Message(kind=Kind.CONTROL, job="t", dst="b/sink/0", generation=1, **_as(ctl.Ended(step=2))))
    running.threads["sink"].join(20)
    assert "a/src/0 sent 'ended' to sink, which does not expect it now" in str(running.errors["sink"])


def test_device_auto_is_the_cpu_here_and_cuda_without_one_is_a_config_error():
    from nebula.errors import ConfigError
    from nebula.runtime.service import resolve_device
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("spec, device_type, local_world, gpus, backend", [
    ("auto", "cpu", 4, 0, "gloo"),      # no GPU: gloo
    ("auto", "cuda", 1, 1, "nccl"),     # one rank, one GPU
    ("auto", "cuda", 2, 2, "nccl"),     # rank r on cuda:r
    ("cuda", "cuda", 4, 8, "nccl"),
    ("auto", "cuda", 2, 1, "gloo"),     # rank 1 would land on cuda:0 too: NCCL refuses ("Duplicate GPU detected")
    ("cuda", "cuda", 4, 2, "gloo"),
    ("cuda:1", "cuda", 1, 2, "nccl"),   # one rank on the GPU named
    ("cuda:1", "cuda", 2, 2, "gloo"),   # every rank on the GPU named
])
def test_ranks_that_would_share_a_gpu_reduce_with_gloo_instead_of_failing_in_nccl(spec, device_type, local_world,
                                                                                  gpus, backend):
    """Found on a 1-GPU machine: a 2-rank stage with device "auto" put both ranks on cuda:0 and NCCL
    stopped it at its first all_reduce; gloo reduces CUDA tensors through host memory."""
    from nebula.runtime.ranks import group_backend
    assert group_backend(spec, device_type, local_world, gpus) == backend
