"""The split runner with a small real torch model over in-process channels: pipelined training equals
unpipelined training, and a stage killed mid-training resumes with no example lost or applied twice."""
import threading
import time

import pytest
import torch

from nebula.codecs import CompressionPolicy
from nebula.runtime.checkpoint import CheckpointDir
from nebula.runtime.job import TrainConfig
from nebula.runtime.link import LinkCodecs
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.schedule import Schedule, digest, id_hash
from nebula.runtime.head import HeadRunner
from nebula.runtime.tail import TailRunner
from nebula.transport.inproc import InProcHub

N, D, H = 64, 8, 16
GEN = torch.Generator().manual_seed(0)
FEATURES, TARGETS = torch.randn(N, D, generator=GEN), torch.randn(N, 1, generator=GEN)
HASHES = torch.tensor([id_hash(f"ex:{i}") for i in range(N)])


class Trainable:
    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def optimizer_step(self, step):
        self.opt.step()

    def state_dict(self):
        return {"m": self.module.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.module.load_state_dict(state["m"])
        self.opt.load_state_dict(state["opt"])


class Head(Trainable):
    def __init__(self):
        self.module = torch.nn.Linear(D, H)
        with torch.no_grad():
            self.module.weight.copy_(torch.linspace(-1, 1, D * H).view(H, D))
            self.module.bias.fill_(0.1)
        self.opt = torch.optim.Adam(self.module.parameters(), lr=1e-2)

    def forward(self, indices, split="train", weights=None):
        out = self.module(FEATURES[indices]) if weights is None else \
            torch.func.functional_call(self.module, weights, (FEATURES[indices],))
        return {"hidden": torch.tanh(out), "ids": HASHES[indices]}

    def trainable(self):
        return dict(self.module.named_parameters())


class Tail(Trainable):
    fail_at = None

    def __init__(self):
        self.module = torch.nn.Linear(H, 1)
        with torch.no_grad():
            self.module.weight.copy_(torch.linspace(-1, 1, H).view(1, H))
            self.module.bias.fill_(-0.1)
        self.opt = torch.optim.Adam(self.module.parameters(), lr=1e-2)
        self.by_hash = {int(h): i for i, h in enumerate(HASHES)}
        self.steps_done = 0

    def loss(self, inputs):
        rows = [self.by_hash[int(h)] for h in inputs["ids"]]
        return ((self.module(inputs["hidden"]) - TARGETS[rows]) ** 2).mean()

    def optimizer_step(self, step):
        if step == self.fail_at:
            raise KeyboardInterrupt("injected crash")  # a process dying, not an error it handles
        super().optimizer_step(step)


def reference(train: TrainConfig):
    """Unpipelined: one process, same micro-batches, one optimizer step per step. With staleness 1,
    step t's head forward and backward use the head weights after step t-2 (after t-1 when step t-1
    ended with a checkpoint), and its gradient updates the current weights."""
    head, tail, schedule = Head(), Tail(), Schedule(N, train.batch_size, train.seed)
    after = {0: {k: p.detach().clone() for k, p in head.trainable().items()}}  # head weights after each step
    for step in range(1, train.steps + 1):
        stale = train.staleness and step > 1 and (step - 1) % train.checkpoint_every
        used = {k: v.clone().requires_grad_() for k, v in after[step - 2 if stale else step - 1].items()}
        head.zero_grad(); tail.zero_grad()
        idx = schedule.indices(step)
        for m in range(train.micro_batches):
            chunk = idx[m::train.micro_batches]
            out = head.forward(chunk, weights=used)
            received = out["hidden"].detach().requires_grad_()
            (tail.loss({"hidden": received, "ids": out["ids"]}) / train.micro_batches).backward()
            out["hidden"].backward(received.grad)
        for k, p in head.trainable().items():
            p.grad = used[k].grad
        head.opt.step(); tail.opt.step()
        after[step] = {k: p.detach().clone() for k, p in head.trainable().items()}
    return head, tail


def runner(cls, hub_channel, peer, model, train, tmp_path, name, policy, timeout=20.0):
    return cls(job="t", channel=hub_channel, peer=peer, model=model,
               codecs=LinkCodecs(CompressionPolicy.from_dict(policy), "link"), train=train,
               checkpoints=CheckpointDir(tmp_path / name), metrics=MetricsLog(None, name, quiet=True),
               timeout=timeout)


def start(target):
    errors = []

    def wrapped():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
    thread = threading.Thread(target=wrapped, daemon=True)
    thread.start()
    return thread, errors


TRAIN = TrainConfig(steps=12, batch_size=16, micro_batches=4, checkpoint_every=3, lr=1e-2)
STALE = TrainConfig(steps=12, batch_size=16, micro_batches=4, checkpoint_every=3, lr=1e-2, staleness=1)
IDENTITY = {"forward": "none", "backward": "none"}


def run_pair(tmp_path, tail_model, train=TRAIN, policy=IDENTITY, timeout=20.0):
    hub = InProcHub()
    head = runner(HeadRunner, hub.channel("a/encoder/0"), "b/decoder/0", Head(), train, tmp_path, "head", policy,
                  timeout)
    tail = runner(TailRunner, hub.channel("b/decoder/0"), "a/encoder/0", tail_model, train, tmp_path, "tail",
                  policy, timeout)
    return hub, head, tail


def train_head(head, train):
    head.run(Schedule(N, train.batch_size, train.seed))
    head.finish()


@pytest.mark.parametrize("train", [TRAIN, STALE], ids=["sync", "stale"])
def test_pipelined_equals_unpipelined(tmp_path, train):
    hub, head, tail = run_pair(tmp_path, Tail(), train)
    t_tail, e_tail = start(tail.run)
    train_head(head, train)
    t_tail.join(10)
    assert not e_tail and not t_tail.is_alive()
    ref_head, ref_tail = reference(train)
    for got, want in [(head.model.module, ref_head.module), (tail.model.module, ref_tail.module)]:
        for p, q in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    expected = [[s, digest(HASHES[Schedule(N, 16, 1).indices(s)].tolist())] for s in range(1, 13)]
    assert head.ledger == tail.ledger == expected


def test_lossy_codec_stays_close_to_reference(tmp_path):
    hub, head, tail = run_pair(tmp_path, Tail(), policy={"forward": "fp16", "backward": "int8"})
    t_tail, _ = start(tail.run)
    train_head(head, TRAIN)
    t_tail.join(10)
    ref_head, _ = reference(TRAIN)
    diff = (head.model.module.weight - ref_head.module.weight).abs().max()
    assert 0 < diff < 0.05  # compressed, so not identical, but close


def test_stale_schedule_differs_from_sync():
    """The staleness-1 reference is a different optimisation path, so the test above checks something."""
    sync, stale = reference(TRAIN)[0].module.weight, reference(STALE)[0].module.weight
    assert not torch.allclose(sync, stale, atol=1e-4)


@pytest.mark.parametrize("train", [TRAIN, STALE], ids=["sync", "stale"])
def test_tail_killed_mid_training_resumes_without_loss_or_repeat(tmp_path, train):
    crashing = Tail()
    crashing.fail_at = 8  # dies after checkpoint 6, in the middle of step 8
    hub, head, tail = run_pair(tmp_path, crashing, train)
    t_tail, e_tail = start(tail.run)
    t_head, e_head = start(lambda: train_head(head, train))
    t_tail.join(10)
    assert e_tail and isinstance(e_tail[0], KeyboardInterrupt)
    tail.close()
    restarted = runner(TailRunner, hub.restart("b/decoder/0"), "a/encoder/0", Tail(), train, tmp_path, "tail",
                       IDENTITY)
    t_new, e_new = start(restarted.run)
    t_head.join(20); t_new.join(10)
    assert not e_head and not e_new
    ref_head, ref_tail = reference(train)
    torch.testing.assert_close(head.model.module.weight, ref_head.module.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(restarted.model.module.weight, ref_tail.module.weight, rtol=1e-5, atol=1e-6)
    expected = [[s, digest(HASHES[Schedule(N, 16, 1).indices(s)].tolist())] for s in range(1, 13)]
    assert head.ledger == restarted.ledger == expected
    assert head.generation == 2  # one resume after the initial agreement


class SlowDecodingTail(Tail):
    """Translates each example to its id, taking 0.4 s per batch (a real decoder takes seconds)."""

    def translate(self, inputs):
        time.sleep(0.4)
        return [f"this is example number {int(h)}" for h in inputs["ids"]]

    def references(self, split, hashes):
        return [f"this is example number {int(h)}" for h in hashes]


def test_evaluation_longer_than_the_timeout_completes_reporting_progress(tmp_path):
    train = TrainConfig(steps=3, batch_size=16, micro_batches=4, checkpoint_every=3, lr=1e-2)
    hub, head, tail = run_pair(tmp_path, SlowDecodingTail(), train, timeout=1.0)
    tail.outputs = tmp_path  # where the tail leaves the hypotheses and references
    t_tail, e_tail = start(tail.run)
    head.run(Schedule(N, train.batch_size, train.seed))
    scores = head.evaluate("test", list(range(0, 48)), batch_size=8)  # 6 batches: 2.4 s of decoding
    head.finish()
    t_tail.join(10)
    assert not e_tail and scores["n"] == 48 and scores["bleu"] == pytest.approx(100.0)
    decoded = [r["n"] for r in head.metrics.records if r.get("event") == "decoded"]
    assert decoded[-1] == 48
    hyps = (tmp_path / "test.hyp").read_text().splitlines()
    assert len(hyps) == 48 and hyps == (tmp_path / "test.ref").read_text().splitlines()
