"""A stage's `init_from`: training starts from weights in a file rather than from the stage's random
initialisation (a warm start: fine-tuning, or DiLoCo's regime, replicas started from one synchronously
trained model; docs/runtime.md, docs/replicas.md).

The file is one torch.save'd mapping, any of:
- a Nebula checkpoint (`<workdir>/checkpoints/step-N.pt` of a stage: its `stage` state is taken, after its
  checksum file, where one is beside it, matched);
- a stage's state (`{"weights": ..., "buffers": ...}`, as Stage.state_dict writes it);
- names to tensors (a module's `state_dict()`, or its trainable weights alone).
Only weights and buffers are taken: the optimiser and the LR schedule start as the job says (its warm-up
again), so that the systems a bench compares from one file start alike. Every trainable weight of the
stage must be in it, with its shape; the file's other names are counted, not loaded. A resume from the
stage's own checkpoint overwrites what the file gave.

(ELECTRA's generator has an `init` option of its own, older than this key, for the same hot start from a
checkpoint: services/electra/model.py `load_trained`.)
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nebula.errors import ConfigError, StageError
from nebula.runtime.checkpoint import CheckpointDir

if TYPE_CHECKING:
    from nebula.runtime.stage import Stage

_CHECKPOINT = re.compile(r"step-(\d{8})\.pt")


def read_init(path: Path, stage: str) -> dict[str, torch.Tensor]:
    """The file's weights and buffers by name, on the CPU; a ConfigError that says what it expects."""
    key = f"[stages.{stage}].init_from"
    if not path.is_file():
        raise ConfigError(f"{key}: {path} is not a file at this site; give the path (relative to the job file) of "
                          "a checkpoint or a torch.save'd state_dict, or remove init_from")
    saved: Any
    try:
        step = _CHECKPOINT.fullmatch(path.name)
        if step and Path(f"{path}.sha256").exists():  # a Nebula checkpoint: its checksum first
            saved = CheckpointDir(path.parent).load(int(step.group(1)))
        else:
            saved = torch.load(path, weights_only=True, map_location="cpu")
    except StageError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    except Exception as exc:  # pickle, zip or torch's weights-only refusal: each says the file is not one
        raise ConfigError(f"{key}: {path} is not a torch.save'd mapping of tensors ({exc}); give a Nebula "
                          "checkpoint or a state_dict") from exc
    if isinstance(saved, dict) and isinstance(saved.get("stage"), dict):
        saved = saved["stage"]  # a Nebula checkpoint
    if isinstance(saved, dict) and isinstance(saved.get("weights"), dict):
        saved = {**saved.get("buffers", {}), **saved["weights"]}  # a stage's state
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise ConfigError(f"{key}: {path} holds no mapping of names to tensors; give a Nebula checkpoint, a stage's "
                          "state or a module's state_dict")
    return saved


def load_init(stage: Stage, path: Path) -> dict[str, int]:
    """Stage's weights (and buffers) from the file; -> how many of the file's tensors it took and left."""
    name = stage.context.name
    saved = read_init(path, name)
    own = stage.module.state_dict()
    for key, param in stage.trainable().items():
        if key not in saved:
            held = ", ".join(list(saved)[:3])
            raise ConfigError(f"[stages.{name}].init_from: {path} has no weight {key} (the first of the stage's "
                              f"the file lacks; it holds {len(saved)} tensors, e.g. {held}): was it written by "
                              "another model or stage?")
        if tuple(saved[key].shape) != tuple(param.shape):
            raise ConfigError(f"[stages.{name}].init_from: weight {key} has shape {tuple(saved[key].shape)} in {path}, "
                              f"{tuple(param.shape)} here: was it written by another model size?")
    taken = {k: v for k, v in saved.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    stage.module.load_state_dict(taken, strict=False)
    return {"tensors": len(taken), "unused": len(saved) - len(taken)}
