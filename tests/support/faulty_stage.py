"""A fault-injection encoder for the e2e tests (hivemind-style: a real stage that misbehaves in one
way). It loads no model: it reads the real example ids and returns an integer `hidden` where its
port declares floating point, as a broken encoder would."""
from __future__ import annotations

from pathlib import Path

import torch

from nebula.runtime.stage import Output, Stage
from services.abnet.stages import AbnetEncoder


class IntHiddenEncoder(AbnetEncoder):
    def __init__(self, context, options):
        Stage.__init__(self, context, options)
        self.ids = (Path(context.data) / "train.ids").read_text(encoding="utf-8").split("\n")[:-1]
        self.module = torch.nn.Linear(1, 1)  # nothing to train

    def examples(self, split: str) -> list[str]:
        return self.ids

    def forward(self, batch, inputs) -> Output:
        n = len(batch.indices)
        return Output(tensors={"hidden": torch.ones(n, 4, 384, dtype=torch.int64),  # (B, S, H), wrong dtype
                               "mask": torch.ones(n, 4, dtype=torch.bool)})
