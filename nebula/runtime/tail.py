"""The tail of a split job (site b): holds the target side and the loss, follows the head's
schedule, decodes and scores (see nebula.runtime.split for the protocol)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula.errors import DataError
from nebula.runtime.schedule import digest
from nebula.runtime.split import INPUT_SPLIT, SplitRunner, reports_failure
from nebula.wire import Kind, Message


@dataclass
class StepProgress:
    """What the tail has accumulated of the step in flight (and of an inference pass)."""

    losses: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # example-id hashes, for the ledger
    compute_s: float = 0.0
    hyps: list[str] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)


@dataclass
class TailRunner(SplitRunner):
    """Site b: holds the target side and the loss; follows the head's schedule and resumes.
    ``outputs``: where an evaluation leaves ``{split}.hyp`` and ``{split}.ref`` (one sentence per
    line, same order), for significance tests such as ``sacrebleu REF -i HYP_A HYP_B --paired-bs``;
    they stay at this site, which holds the references."""

    outputs: Path | None = None

    progress: StepProgress = field(default_factory=StepProgress)

    @reports_failure
    def run(self) -> None:
        self.ensure_initial_checkpoint()
        self.hello()
        while True:
            msg = self.recv()
            if msg.kind == Kind.CONTROL:
                if msg.topic == "hello":
                    self.hello()
                elif msg.topic == "resume":
                    self.resume(msg)
                elif msg.topic == "infer-done" and msg.generation == self.generation:
                    self.score(self.body(msg).get("split", "test"))
                elif msg.topic == "done" and msg.generation == self.generation:
                    self.save()
                    self.control("done", step=self.step)
                    self.sender.flush()
                    return
            elif msg.kind == Kind.TENSORS and msg.topic.startswith("infer:") and msg.generation == self.generation:
                self.infer(msg)
            elif msg.kind == Kind.TENSORS and msg.generation == self.generation and msg.step == self.step + 1:
                self.micro_batch(msg)
                if len(self.progress.losses) == self.train.micro_batches:
                    self.finish_step(msg.step)

    def infer(self, msg: Message) -> None:
        split = msg.topic.partition(":")[2]
        inputs = self.received(msg)
        self.progress.hyps += self.model.translate(inputs)
        if split != INPUT_SPLIT:  # user input has no references at this site
            self.progress.refs += self.model.references(split, inputs["ids"])
        # Tells the head decoding goes on: a long evaluation is progress, not a silent peer.
        self.control("infer-progress", split=split, n=len(self.progress.hyps))

    def received(self, msg: Message) -> dict[str, torch.Tensor]:
        """The tensors of a head message, checked: "hidden" floating point (B, S, H), "ids" int64 (B,)."""
        inputs = {t.name: self.codecs.unpack(t) for t in msg.tensors}
        missing = sorted({"hidden", "ids"} - inputs.keys())
        if missing:
            raise DataError(f"{msg.src} sent step {msg.step} without tensor(s) {', '.join(missing)} "
                            f"(got {', '.join(sorted(inputs)) or 'none'}): both stages must run the same job")
        hidden, ids = inputs["hidden"], inputs["ids"]
        if not hidden.is_floating_point():
            raise DataError(f"{msg.src} sent 'hidden' as {hidden.dtype}, expected a floating-point (B, S, H) "
                            "boundary tensor: check the head stage's model and the [compression] codecs")
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.shape[0] != hidden.shape[0]:
            raise DataError(f"{msg.src} sent 'ids' {ids.dtype} {tuple(ids.shape)} for 'hidden' "
                            f"{tuple(hidden.shape)}: expected int64 (B,) example-id hashes, one per row")
        return inputs

    def score(self, split: str) -> None:
        from sacrebleu import corpus_bleu
        hyps, refs = self.progress.hyps, self.progress.refs
        self.progress.hyps, self.progress.refs = [], []
        if split == INPUT_SPLIT:
            self.control("scores", split=split, n=len(hyps), translations=hyps)
            return
        if self.outputs is not None:
            for ext, lines in (("hyp", hyps), ("ref", refs)):
                (self.outputs / f"{split}.{ext}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        bleu = corpus_bleu(hyps, [refs], lowercase=True).score if hyps else 0.0
        scores = {"split": split, "bleu": bleu, "n": len(hyps),
                  "samples": [[h, r] for h, r in zip(hyps[:5], refs[:5])]}
        self.metrics.event("scores", **scores)
        self.control("scores", **scores)

    def resume(self, msg: Message) -> None:
        body = self.body(msg)
        self.generation = int(body["generation"])
        self.restore(int(body["step"]))
        self.progress = StepProgress()  # whatever the abandoned step had accumulated is void
        self.control("ready", step=self.step)

    def micro_batch(self, msg: Message) -> None:
        t0 = time.perf_counter()
        inputs = self.received(msg)
        hidden = inputs["hidden"].detach().float().requires_grad_()
        inputs["hidden"] = hidden
        loss = self.model.loss(inputs)
        (loss / self.train.micro_batches).backward()
        grad = hidden.grad
        step, mb, generation = msg.step, msg.micro_batch, self.generation
        self.sender.submit(lambda: Message(
            kind=Kind.TENSORS, job=self.job, dst=self.peer, step=step, micro_batch=mb, generation=generation,
            tensors=[self.codecs.pack("backward", "grad_hidden", grad, step)]))
        self.progress.ids += inputs["ids"].tolist()
        self.progress.losses.append(loss.item())
        self.progress.compute_s += time.perf_counter() - t0

    def finish_step(self, step: int) -> None:
        t0 = time.perf_counter()
        self.model.optimizer_step(step)
        self.model.zero_grad()  # the next step accumulates its micro-batches from zero
        self.step = step
        self.ledger.append([step, digest(self.progress.ids)])  # equals the head's entry: same example ids
        if step % self.train.checkpoint_every == 0:
            self.save()
        done, self.progress = self.progress, StepProgress(hyps=self.progress.hyps, refs=self.progress.refs)
        self.metrics.step(step=step, loss=sum(done.losses) / len(done.losses),
                          compute_s=done.compute_s + time.perf_counter() - t0,
                          backward_bytes=self.codecs.take_bytes("backward"))
