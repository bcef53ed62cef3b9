"""The example workload's stages: y = sin(x . w) learnt by a chain of small layers split over sites.

Each stage generates the same data set from `data_seed` (a stand-in for data that stays at its own
site): the source reads the features x, the sink looks its targets y up by example id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from nebula.config import limits
from nebula.runtime.order import id_hash
from nebula.runtime.stage import FLOAT, Batch, Output, Port, Stage

SPLITS = {"train": 1.0, "test": 0.25}  # sizes relative to `examples`


@dataclass(frozen=True, kw_only=True)
class Options:
    width: int = field(default=16, metadata=limits(at_least=1))
    features: int = field(default=8, metadata=limits(at_least=1))
    examples: int = field(default=64, metadata=limits(at_least=1))
    lr: float = field(default=1e-2, metadata=limits(above=0, below=1))
    data_seed: int = 0
    local_loss: bool = False  # the source also fits y itself (as Scenario I's generator has its own loss)
    eval_examples: int = field(default=0, metadata=limits(at_least=0))  # the source evaluates after training


def dataset(options: Options, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (N, F), y (N, 1)) of `split`, the same at every stage."""
    gen = torch.Generator().manual_seed(options.data_seed * 7919 + list(SPLITS).index(split))
    teacher = torch.randn(options.features, 1, generator=torch.Generator().manual_seed(options.data_seed))
    x = torch.randn(max(1, int(options.examples * SPLITS[split])), options.features, generator=gen)
    return x, torch.sin(x @ teacher)


class _Example(Stage):
    Options = Options

    def __init__(self, context, options: Options):
        super().__init__(context, options)
        self.data = {split: dataset(options, split) for split in SPLITS}
        self.ids = {split: [f"{split}:{i}" for i in range(len(self.data[split][0]))] for split in SPLITS}
        self.row = {split: {id_hash(i): r for r, i in enumerate(ids)} for split, ids in self.ids.items()}

    def examples(self, split: str) -> list[str]:
        return self.ids[split]

    def targets(self, batch: Batch) -> torch.Tensor:
        """y of the batch's examples, found by their id hashes."""
        return self.data[batch.split][1][[self.row[batch.split][int(h)] for h in batch.ids]].to(self.device)

    def _optimise(self) -> None:
        self.module.to(self.device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=self.options.lr)


class Source(_Example):
    """Reads x; sends hidden = tanh(W x) (B, width); with local_loss also fits y from it."""

    outputs = (Port("hidden", FLOAT, rank=2, shape=("width",)),)

    def __init__(self, context, options: Options):
        super().__init__(context, options)
        self.module = torch.nn.ModuleDict({"layer": torch.nn.Linear(options.features, options.width),
                                           "head": torch.nn.Linear(options.width, 1)})
        self._optimise()

    def after_training(self, runner) -> None:
        """Score the test split through the whole chain; scores.json here."""
        if self.options.eval_examples:
            test = list(range(min(self.options.eval_examples, len(self.examples("test")))))
            scores = runner.evaluate("test", test, batch_size=8)
            (self.context.workdir / "scores.json").write_text(json.dumps(scores))

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        hidden = torch.tanh(self.module["layer"](self.data[batch.split][0][batch.indices].to(self.device)))
        loss = None
        if self.options.local_loss and batch.training:
            loss = ((self.module["head"](hidden) - self.targets(batch)) ** 2).mean()
        return Output(tensors={"hidden": hidden}, loss=loss)


class Middle(_Example):
    """hidden -> tanh(W hidden)."""

    inputs = (Port("hidden", FLOAT, rank=2, shape=("width",)),)
    outputs = (Port("hidden", FLOAT, rank=2, shape=("width",)),)

    def __init__(self, context, options: Options):
        super().__init__(context, options)
        self.module = torch.nn.Linear(options.width, options.width)
        self._optimise()

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        return Output(tensors={"hidden": torch.tanh(self.module(inputs["hidden"]))})


class Sink(_Example):
    """Predicts y from hidden; the loss is the squared error; inference scores the mean squared error."""

    inputs = (Port("hidden", FLOAT, rank=2, shape=("width",)),)

    def __init__(self, context, options: Options):
        super().__init__(context, options)
        self.module = torch.nn.Linear(options.width, 1)
        self._optimise()

    def forward(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> Output:
        return Output(loss=((self.module(inputs["hidden"]) - self.targets(batch)) ** 2).mean())

    def infer(self, batch: Batch, inputs: dict[str, torch.Tensor]) -> list[float]:
        return [float(e) for e in ((self.module(inputs["hidden"]) - self.targets(batch)) ** 2).squeeze(1)]

    def score(self, split: str, results: list[float]) -> dict:
        return {"split": split, "n": len(results), "mse": sum(results) / max(1, len(results))}
