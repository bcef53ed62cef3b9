"""A stage's `init`: training starts from weights in a file rather than from the stage's random
initialisation (a warm start: fine-tuning, or DiLoCo's regime, replicas started from one synchronously
trained model; docs/runtime.md, docs/replicas.md).

The file is one torch.save'd mapping, any of:
- a Nebula checkpoint (`<workdir>/checkpoints/step-N.pt` of a stage: its `stage` state is taken);
- a stage's state (`{"weights": ..., "buffers": ...}`, as Stage.state_dict writes it);
- names to tensors (a module's `state_dict()`, or its trainable weights alone).
Only weights and buffers are taken: the optimiser and the LR schedule start as the job says (its warm-up
again), so that the systems a bench compares from one file start alike. Every trainable weight of the
stage must be in it, with its shape; the file's other names are counted, not loaded. A checkpoint of the
stage's own run comes first: `init` applies to a first start only, as a resume overwrites it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nebula.errors import ConfigError

if TYPE_CHECKING:
    from nebula.runtime.stage import Stage


def read_init(path: Path, stage: str) -> dict[str, torch.Tensor]:
    """The file's weights and buffers by name, on the CPU; a ConfigError that says what it expects."""
    if not path.is_file():
        raise ConfigError(f"[stages.{stage}].init: {path} is not a file at this site; give the path (relative to "
                          "the job file) of a checkpoint or a torch.save'd state_dict, or remove `init`")
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # pickle, zip or torch's weights-only refusal: each says the file is not one
        raise ConfigError(f"[stages.{stage}].init: {path} is not a torch.save'd mapping of tensors ({exc}); "
                          "give a Nebula checkpoint or a state_dict") from exc
    if isinstance(saved, dict) and isinstance(saved.get("stage"), dict):
        saved = saved["stage"]  # a Nebula checkpoint
    if isinstance(saved, dict) and isinstance(saved.get("weights"), dict):
        saved = {**saved.get("buffers", {}), **saved["weights"]}  # a stage's state
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise ConfigError(f"[stages.{stage}].init: {path} holds no mapping of names to tensors; give a Nebula "
                          "checkpoint, a stage's state or a module's state_dict")
    return saved


def load_init(stage: Stage, path: Path) -> dict[str, int]:
    """Stage's weights (and buffers) from the file; -> how many of the file's tensors it took and left."""
    name = stage.context.name
    saved = read_init(path, name)
    own = stage.module.state_dict()
    for key, param in stage.trainable().items():
        if key not in saved:
            raise ConfigError(f"[stages.{name}].init: {path} has no weight {key} (the first of the stage's the file "
                              f"lacks; it holds {len(saved)} tensors, e.g. {', '.join(list(saved)[:3])}): was it "
                              "written by another model or stage?")
        if tuple(saved[key].shape) != tuple(param.shape):
            raise ConfigError(f"[stages.{name}].init: weight {key} has shape {tuple(saved[key].shape)} in {path}, "
                              f"{tuple(param.shape)} here: was it written by another model size?")
    taken = {k: v for k, v in saved.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    stage.module.load_state_dict(taken, strict=False)
    return {"tensors": len(taken), "unused": len(saved) - len(taken)}
