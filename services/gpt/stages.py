"""GPT stage modules: the model's blocks split over sites, activations forward and their gradients back.

    gpt-first   reads its windows, embeds them, runs its blocks, sends "hidden"   (B, T, d or k)
    gpt-middle  receives "hidden", runs its blocks, sends "hidden"
    gpt-last    receives "hidden", runs its blocks, the head and the loss; scores validation loss
    gpt-whole   all of it in one stage: the unsplit reference

Every stage reads the corpus itself and finds the tokens of a message's examples by their id hashes.
Before building anything each stage checks the whole job's split (services.gpt.split).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from nebula.config import limits
from nebula.errors import ConfigError
from nebula.runtime.lr import warmup_decay
from nebula.runtime.stage import FLOAT, Batch, Output, Port, Stage
from services.gpt.data import TokenWindows
from services.gpt.model import GptConfig, GptPart, lm_loss
from services.gpt.split import check_split

HIDDEN = Port("hidden", FLOAT, rank=3)  # (B, T, d), or (B, T, k) through a bottleneck


@dataclass(frozen=True, kw_only=True)
class GptOptions:
    vocab_size: int = field(default=8192, metadata=limits(at_least=2, at_most=65535))
    d_model: int = field(default=256, metadata=limits(at_least=2))
    n_head: int = field(default=4, metadata=limits(at_least=1))
    n_layer: int = field(default=8, metadata=limits(at_least=1))
    seq_len: int = field(default=256, metadata=limits(at_least=2))
    layers: tuple[int, ...] = ()  # [first, last): the blocks this stage holds
    # width k of the learned code on this stage's boundary links (0: the residual stream, d_model wide)
    bottleneck: int = field(default=0, metadata=limits(at_least=0))
    reembed: bool = True  # with a bottleneck: the receiver adds its own embedding of the tokens it reads
    # without one: the receiver adds its own embedding of the tokens to the stream it receives (the code
    # model's tables on a dense link: the baseline that tells the code from the tables)
    reembed_stream: bool = False
    tie_embeddings: bool = False  # gpt-whole only: the head shares the embedding's weights
    lr: float = field(default=1e-3, metadata=limits(above=0, below=1))
    warmup_steps: int = field(default=20, metadata=limits(at_least=0))  # linear warm-up, then lr_schedule
    # after the warm-up: constant, or a linear or cosine decay to 0 at the job's last step (nebula.runtime.lr;
    # cosine is the usual GPT recipe, and DiLoCo's inner one: docs/replicas.md)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = field(default=0.0, metadata=limits(at_least=0))
    # the first stage scores the validation loss after training on this many windows spread over the split
    eval_examples: int = field(default=0, metadata=limits(at_least=0, hint="0: no evaluation"))
    eval_batch_size: int = field(default=16, metadata=limits(at_least=1))


class _Gpt(Stage):
    Options = GptOptions
    stats = ("tokens",)  # also gives each link's bytes per token
    embeds = heads = False

    def __init__(self, context, options: GptOptions):
        super().__init__(context, options)
        check_split(context.job, ROLES)  # before any model is built
        o = options
        if context.data is None:
            raise ConfigError("[job].data is required: the GPT stages read `nebula data prepare-text`'s corpus")
        self.data = TokenWindows(context.data, o.seq_len, o.vocab_size)
        cfg = GptConfig(vocab_size=o.vocab_size, d_model=o.d_model, n_head=o.n_head, n_layer=o.n_layer,
                        seq_len=o.seq_len)
        code_in = o.bottleneck if isinstance(self, (GptMiddle, GptLast)) else 0
        code_out = o.bottleneck if isinstance(self, (GptFirst, GptMiddle)) else 0
        self.module = GptPart(cfg, o.layers[0], o.layers[1], embed=self.embeds, head=self.heads, code_in=code_in,
                              code_out=code_out, reembed=o.reembed, tie=o.tie_embeddings,
                              stream_embed=o.reembed_stream).to(self.device)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=o.lr, betas=(0.9, 0.95),
                                           weight_decay=o.weight_decay)
        factor = warmup_decay(o.warmup_steps, o.lr_schedule, context.job.train.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def tokens(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the batch, (B, T) each: by position at the source, else by example id."""
        rows = batch.indices if batch.indices is not None else self.data.lookup(batch.split, batch.ids)
        inputs, targets = self.data.windows(batch.split, rows)
        return inputs.to(self.device), targets.to(self.device)

    def examples(self, split: str) -> list[str]:
        return self.data.ids[split]

    def _count(self, inputs: torch.Tensor) -> dict[str, float]:
        return {"tokens": float(inputs.numel())}


class GptFirst(_Gpt):
    outputs = (HIDDEN,)
    embeds = True

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        tokens, _ = self.tokens(batch)
        return Output(tensors={"hidden": self.module(tokens)}, stats=self._count(tokens))

    def after_training(self, runner) -> None:
        """Score the validation loss across the sites; scores-valid.json here, and a line of valid.jsonl
        (one per evaluation, so a job run in parts keeps its curve). With replicas, replica 0 scores: after
        the job's last round every replica holds the same outer weights."""
        if self.options.eval_examples and self.context.job.replica == 0:
            scores = evaluate(runner, self.data, self.options)
            (self.context.workdir / "scores-valid.json").write_text(json.dumps(scores, indent=1))
            with open(self.context.workdir / "valid.jsonl", "a") as log:
                log.write(json.dumps({"step": runner.step, "loss": scores["loss"]}) + "\n")


class GptMiddle(_Gpt):
    inputs = (HIDDEN,)
    outputs = (HIDDEN,)

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        tokens, _ = self.tokens(batch)
        return Output(tensors={"hidden": self.module(tokens, inputs["hidden"].float())}, stats=self._count(tokens))


class _Scores(_Gpt):
    """The loss end of the model: training loss, and per-window validation losses it scores."""

    heads = True

    def infer(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> list[list[float]]:
        """[summed loss, tokens] per window."""
        tokens, targets = self.tokens(batch)
        logits = self.module(tokens, inputs["hidden"].float() if inputs else None)
        return [[float(s), targets.shape[1]] for s in lm_loss(logits, targets, reduction="sum_rows")]

    def score(self, split: str, results: list[Any]) -> dict[str, Any]:
        total, n = sum(r[0] for r in results), sum(r[1] for r in results)
        loss = total / max(1, n)
        return {"split": split, "n": len(results), "tokens": n, "loss": loss, "ppl": math.exp(min(loss, 50))}


class GptLast(_Scores):
    inputs = (HIDDEN,)

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        tokens, targets = self.tokens(batch)
        loss = lm_loss(self.module(tokens, inputs["hidden"].float()), targets)
        return Output(loss=loss, stats=self._count(tokens))


class GptWhole(_Scores):
    """The unsplit model in one stage (source and sink): the reference a split must equal."""

    embeds = True

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        tokens, targets = self.tokens(batch)
        return Output(loss=lm_loss(self.module(tokens), targets), stats=self._count(tokens))

    after_training = GptFirst.after_training


def eval_windows(data: TokenWindows, options: GptOptions) -> list[int]:
    """The `eval_examples` validation windows the loss is scored on, spread over the split (the same ones
    every time, whoever scores them: the runtime's evaluation, or a peer's)."""
    total = len(data.ids["valid"])
    n = min(options.eval_examples, total)
    return [i * total // n for i in range(n)]


def evaluate(runner, data: TokenWindows, options: GptOptions) -> dict[str, Any]:
    """The validation loss over `eval_examples` windows spread over the split (the same ones every time)."""
    scores = runner.evaluate("valid", eval_windows(data, options), options.eval_batch_size)
    if len(scores) != 1:
        raise ConfigError(f"a GPT job has one loss stage; the evaluation reached {sorted(scores)}")
    return {**next(iter(scores.values())), "step": runner.step}


ROLES = {GptFirst: "first", GptMiddle: "middle", GptLast: "last", GptWhole: "whole"}
