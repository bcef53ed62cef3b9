"""Per-stage checkpoints: atomic writes, a checksum that catches corruption, the last few kept."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from nebula.errors import StageError

_NAME = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointDir:
    """`<dir>/step-00000120.pt` files, each followed by its sha256 in `<file>.sha256`; the `keep` newest
    and step 0 stay."""

    def __init__(self, path: str | Path, keep: int = 3):
        self.path, self.keep = Path(path), keep
        self.path.mkdir(parents=True, exist_ok=True)
        self._verified: dict[tuple, bool] = {}  # (step, size, mtime) -> checksum matched

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint (data and checksum both written), ascending."""
        found = (_NAME.match(p.name) for p in self.path.iterdir())
        return sorted(int(m.group(1)) for m in found
                      if m and (self.path / f"{m.group(0)}.sha256").exists())

    def verified_steps(self, warn: Callable[[str], None]) -> list[int]:
        """Steps whose checkpoint matches its checksum; a corrupt one is skipped and `warn`ed about.
        Each file is hashed once per (size, mtime)."""
        good = []
        for step in self.steps():
            path = self.file(step)
            try:
                stat = path.stat()
                key = (step, stat.st_size, stat.st_mtime_ns)
                if key not in self._verified:
                    expected = Path(f"{path}.sha256").read_text().strip()
                    self._verified[key] = hashlib.sha256(path.read_bytes()).hexdigest() == expected
                    if not self._verified[key]:
                        warn(f"checkpoint {path} is corrupt (checksum mismatch): skipping it, an earlier "
                             "checkpoint will be used; delete the file to silence this warning")
            except FileNotFoundError:
                continue  # pruned meanwhile
            if self._verified[key]:
                good.append(step)
        return good

    def file(self, step: int) -> Path:
        return self.path / f"step-{step:08d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` as checkpoint `step`; a StageError, and nothing written, if any floating tensor in it
        (a weight, a buffer, an optimiser moment) holds a NaN or Inf: a resume must never start from one."""
        bad = non_finite(state)
        if bad:
            raise StageError(f"refusing to save checkpoint step {step}: {len(bad)} tensors hold NaN/Inf values "
                             f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); the last checkpoint "
                             f"({max(self.steps(), default=0)}) holds finite ones")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        target = self.file(step)
        _atomic_write(target, data)
        # the checksum is written last: its presence marks the checkpoint complete
        _atomic_write(Path(f"{target}.sha256"), hashlib.sha256(data).hexdigest().encode())
        self._prune()
        return target

    def load(self, step: int) -> dict[str, Any]:
        target = self.file(step)
        try:
            data = target.read_bytes()
            expected = Path(f"{target}.sha256").read_text().strip()
        except FileNotFoundError as exc:
            raise StageError(f"checkpoint {target} is missing; available steps: {self.steps()}") from exc
        if hashlib.sha256(data).hexdigest() != expected:
            raise StageError(f"checkpoint {target} is corrupt (checksum mismatch); delete it to fall back "
                             "to an earlier one")
        try:
            return read(data)
        except Exception as exc:  # torch raises many types for a bad pickle stream
            raise StageError(f"checkpoint {target} cannot be read: {exc}") from exc

    def _prune(self) -> None:
        for step in self.steps()[1:-self.keep]:  # never step 0: the one checkpoint every stage has
            self.file(step).unlink(missing_ok=True)
            Path(f"{self.file(step)}.sha256").unlink(missing_ok=True)


def non_finite(state: Any, path: str = "") -> list[str]:
    """The paths (`stage.weights.layer.weight`) of the floating tensors in `state` that hold a NaN or Inf."""
    if isinstance(state, torch.Tensor):
        # a finite sum proves every value finite (one pass); else look at the values themselves
        finite = not state.is_floating_point() or not state.numel() \
            or bool(torch.isfinite(state.sum(dtype=torch.float64))) or bool(torch.isfinite(state).all())
        return [] if finite else [path or "(state)"]
    if isinstance(state, dict):
        return [bad for key, value in state.items() for bad in non_finite(value, f"{path}.{key}" if path else str(key))]
    if isinstance(state, (list, tuple)):
        return [bad for i, value in enumerate(state) for bad in non_finite(value, f"{path}[{i}]")]
    return []


def checkpoints_to_keep(stages: int, horizon: int, checkpoint_every: int) -> int:
    """Enough that the stage furthest ahead still holds the newest checkpoint of the one furthest
    behind: a sender runs at most the schedule's horizon (its pace credit + 2) steps ahead of a
    receiver, per link of a chain (the runner refuses more); at least 3."""
    lag = (stages - 1) * horizon
    return max(3, 2 + -(-lag // checkpoint_every))


def read(data: bytes) -> dict[str, Any]:
    """A checkpoint's bytes -> its state, every tensor on the CPU: one written on a GPU site must load
    at a CPU-only one (a hot start across sites); load_state_dict then copies each to its device."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random generators a checkpoint restores: the CPU's, and the stage's GPU's (dropout there)."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["rng"])
    if device.type == "cuda" and "cuda_rng" in state:  # absent when written on a CPU site
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


FINISHED = "finished.json"  # in a stage's workdir: the job ran to its last step there


def mark_finished(workdir: Path, steps: int) -> None:
    """Written once a stage has trained to `steps` and ended the job with the others (final checkpoint,
    evaluation, inference): a start after that has nothing left to do."""
    _atomic_write(Path(workdir) / FINISHED, json.dumps({"steps": steps}).encode())


def finished_steps(workdir: Path) -> int | None:
    """The steps a stage finished a job at in `workdir`, or None (never finished, or not readable)."""
    try:
        return int(json.loads((Path(workdir) / FINISHED).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
