"""The Stage interface: what a deployable stage service implements (see services/ for implementations)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from nebula.errors import StageError
from nebula.runtime.job import JobConfig
from nebula.transport.base import Channel


class Stage(ABC):
    """One part of a model at one site. It is handed its channel and never opens sockets itself."""

    stage_name: ClassVar[str]

    def __init__(self, job: JobConfig, name: str, workdir: Path, quiet: bool = False):
        self.job, self.name, self.workdir, self.quiet = job, name, Path(workdir), quiet
        self.config = job.stage(name)
        self.workdir.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def run(self, channel: Channel) -> None:
        """Train (and evaluate) until the job is done; resumable after a crash from `workdir`."""

    def translate(self, channel: Channel, lines: list[str]) -> list[str]:
        """Inference driven from this stage (the first stage of a job implements it)."""
        raise StageError(f"stage {self.name} ({self.stage_name}) cannot drive inference: run `nebula translate` "
                         "at the site of the job's first stage")
