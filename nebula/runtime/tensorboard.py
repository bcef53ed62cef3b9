"""Training scalars for TensorBoard ([train] tensorboard = true): rank 0 of each stage writes its step
records with torch.utils.tensorboard under <workdir>/tensorboard (`tensorboard --logdir RUN_DIR` shows
every stage of a run side by side). The tensorboard package is optional: `pip install tensorboard`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from nebula.errors import ConfigError

SKIP = ("t", "kind", "step")  # the record's time, kind and x axis


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a step record, nested tables as tag paths ("sent/enc|dec:forward")."""
    for key, value in record.items():
        if key in SKIP and not prefix:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag, float(value)


class TensorBoardLog:
    """A MetricsLog listener: each step record's numbers as scalars at its step."""

    def __init__(self, logdir: Path, label: str) -> None:
        try:  # why here: the optional tensorboard package, slow to import; only jobs that ask for it pay
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(f"[train] tensorboard = true (stage {label}) needs the tensorboard package, which "
                              "is not installed: pip install tensorboard (or set tensorboard = false)") from exc
        self.writer = SummaryWriter(log_dir=str(logdir))

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("kind") != "step":
            return
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, global_step=record["step"])
        self.writer.flush()  # one small append per step: a crash loses nothing already trained

    def close(self) -> None:
        self.writer.close()
