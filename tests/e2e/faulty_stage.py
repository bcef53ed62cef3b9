"""A fault-injection head stage for the e2e tests (hivemind-style: a real stage that misbehaves in one
way). It loads no model: it sends the real example-id hashes of the schedule with an integer `hidden`,
as a broken or mismatched encoder would, so the real decoder must refuse it with a clear error."""
from __future__ import annotations

from pathlib import Path

import torch

from nebula.runtime.head import HeadRunner
from nebula.runtime.schedule import Schedule, id_hash
from nebula.transport.base import Channel
from services.abnet.stages import AbnetEncoder


class IntHidden:
    """A HeadModel whose boundary tensor is int64 (B, S, 384) instead of floating point."""

    def __init__(self, data_dir: str):
        ids = (Path(data_dir) / "train.ids").read_text(encoding="utf-8").split("\n")[:-1]
        self.hashes, self.n_train = torch.tensor([id_hash(i) for i in ids]), len(ids)

    def forward(self, indices: list[int], split: str = "train", weights=None) -> dict[str, torch.Tensor]:
        hidden = torch.ones(len(indices), 4, 384, dtype=torch.int64)  # (B, S, H), wrong dtype
        return {"hidden": hidden, "mask": torch.ones(len(indices), 4, dtype=torch.bool),
                "ids": self.hashes[indices]}

    def zero_grad(self) -> None: ...
    def trainable(self) -> dict: return {}
    def optimizer_step(self, step: int) -> None: ...
    def state_dict(self) -> dict: return {}
    def load_state_dict(self, state: dict) -> None: ...


class IntHiddenEncoder(AbnetEncoder):
    def run(self, channel: Channel) -> None:
        model = IntHidden(self.job.data)
        runner = HeadRunner(**self.runner_args(channel, model))
        try:
            runner.run(Schedule(model.n_train, self.job.train.batch_size, self.job.train.seed))
        finally:
            runner.close()
