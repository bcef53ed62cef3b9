"""The split workload's side of the replicas bench's peer (`nebula bench wan --scenario replicas --workload
split --peer ddp`, nebula_lab.bench.ddp_peer): a model a user brings (`impl = "split"`, no points: the whole
model in one stage, deploy/jobs/split-replicas.toml), trained by PyTorch DDP exactly as the stage trains it.

Not a table of its own: `nebula bench wan --scenario split` says so. Each hook takes the stage the peer's
rank built (nebula.runtime.service.build_stage), so the module, its initialisation, optimiser, data and loss
are the stage's own; the validation loss is scored by the stage's own evaluation path (SplitStage.score_here:
the same rows, pieces and per-example sums as an evaluation across the sites)."""
from __future__ import annotations

from typing import Any


class SplitPeer:
    peer_only = True  # no bench table of its own: a peer for the replicas bench (nebula_lab.bench.scenarios)

    def __init__(self) -> None:
        self._loss: Any = None  # the stage's loss, set by peer_module: peer_loss gets no stage

    def peer_module(self, stage: Any, first: bool, last: bool, dtype: Any) -> Any:
        """The whole model as one module: the model's inputs (a dict, as peer_batch gives them) in, its output
        out (what the loss takes)."""
        import torch

        from nebula.errors import ConfigError
        if not (first and last and stage.last and stage.options.part == 0):
            raise ConfigError(f"stage {stage.context.name}: the split workload's peer runs a whole model (a stage "
                              "with no points), not a part of one")
        self._loss = (stage.options.loss, stage.loss)

        class Whole(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = stage.module  # the part's traced module: its parameters are the stage's

            def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
                return stage.part.run({}, inputs)
        return Whole()

    def peer_batch(self, stage: Any, indices: list[int]) -> tuple[Any, Any]:
        """(the model's inputs, the targets) of the training examples at `indices`."""
        inputs = {k: v.to(stage.device) for k, v in stage.data.inputs("train", indices).items()
                  if k in stage.part.inputs}
        return inputs, stage.data.targets("train", indices).to(stage.device)

    def peer_loss(self, output: Any, target: Any) -> Any:
        from services.split.losses import checked
        name, loss = self._loss
        return checked(loss, name, output, target)

    def peer_eval(self, stage: Any, module: Any) -> float:
        """The validation loss the stage's evaluation after training would report (its `eval_split`)."""
        return float(stage.score_here(stage.options.eval_split, stage.eval_rows())["loss"])


SCENARIO = SplitPeer()
