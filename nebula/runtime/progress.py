"""A stage's applied steps: the ledger, each step's metrics record, and the checkpoints that hold them.

What a checkpoint holds (nebula.runtime.checkpoint writes it atomically): the stage's own state, the
step and the ledger, every link's codec state, the random generators, and with replicas the outer state
(anchors, momentum, version of each fragment: nebula.runtime.replicas). A restore puts each back where it
lives: the stage, the board (which steps are open), the links' codecs, the computation (and its ranks),
the outer rounds.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from nebula.errors import LinkDown, StageError
from nebula.runtime.board import Board, StepState
from nebula.runtime.checkpoint import CheckpointDir, checkpoints_to_keep, rng_state, set_rng_state
from nebula.runtime.compute import Compute, Tally
from nebula.runtime.job import JobConfig
from nebula.runtime.metrics import MetricsLog
from nebula.runtime.order import digest
from nebula.runtime.outbox import Outbox
from nebula.runtime.stage import Stage


class Progress:
    def __init__(self, job: JobConfig, stage: Stage, workdir: Path, metrics: MetricsLog, board: Board,
                 outbox: Outbox, compute: Compute):
        self.job, self.train, self.stage, self.workdir, self.metrics = job, job.train, stage, Path(workdir), metrics
        self.board, self.outbox, self.compute = board, outbox, compute
        every = self.train.checkpoint_every  # with replicas a checkpoint also precedes every outer round
        if job.replicas is not None:
            every = min(every, job.replicas.config.H // job.replicas.config.fragments)
        self.checkpoints = CheckpointDir(self.workdir / "checkpoints", checkpoints_to_keep(
            len(job.graph.stages), job.schedule.horizon, every))
        self.ledger: list[list[Any]] = []  # [step, digest of its example ids] per applied step
        self.last_update: float | None = None
        self.saved = -1  # the step this process last saved
        self.parts: dict[str, Any] = {}  # more state a checkpoint keeps: name -> object with state_dict()

    @property
    def step(self) -> int:
        return self.board.applied

    def applied(self, state: StepState, tally: Tally) -> None:
        """Step `state.step` was applied: its ledger entry, its metrics record, its checkpoint if one is due."""
        now, t = time.perf_counter(), state.step
        self.outbox.integrity.check_loss(tally.loss, t)  # a non-finite loss: stop before the step counts or is saved
        since = state.started if self.last_update is None else self.last_update  # update to update
        self.board.applied, self.last_update = t, now
        self.ledger.append([t, digest(state.ids)])
        if tally.stats.get("tokens"):  # bytes_per_token below: this step's messages, all encoded, none of the next
            self.outbox.sender.settle()
        sent = self.outbox.take_bytes()  # wire bytes encoded since the last record (link.jsonl has them by step)
        extra: dict[str, Any] = {} if tally.loss is None else {"loss": tally.loss}
        if tally.stats:
            extra["stats"] = tally.stats
            if tally.stats.get("tokens"):  # what one token of this stage's data costs on each link
                extra["bytes_per_token"] = {k: round(n / tally.stats["tokens"], 4) for k, n in sent.items()}
        self.metrics.step(step=t, step_s=now - since, compute_s=tally.compute_s, **extra, sent=sent)
        # saved after the step's record: a kill in between runs the step again (two records, the last
        # counts), where saving first could leave an applied step with no record at all
        if self.train.saves_after(t):
            self.save()

    def skipped(self, t: int) -> None:
        """Step t was moved past unapplied (a bad tensor's, nebula.runtime.aborts): the ledger says so, and its
        checkpoint is written if one is due (the weights are those of step t - 1)."""
        self.board.skip(t)
        self.ledger.append([t, "skipped"])
        self.metrics.event("skipped", step=t)
        if self.train.saves_after(t):
            self.save()

    def save(self) -> None:
        self.outbox.sender.settle()  # the codec state then covers exactly the messages sent so far
        path = self.checkpoints.save(self.step, {
            "stage": self.stage.state_dict(), "step": self.step, "ledger": self.ledger,
            "codecs": self.outbox.codec_state(), **rng_state(self.stage.device), "seed": self.train.seed,
            **{name: part.state_dict() for name, part in self.parts.items()}})
        self.saved = self.step
        self.metrics.event("checkpoint", step=self.step, file=str(path))

    def restore(self, step: int) -> None:
        """Load checkpoint `step` (0: the initial state saved at the first start)."""
        state = self.checkpoints.load(step)
        self.stage.load_state_dict(state["stage"])
        self.ledger = [list(e) for e in state["ledger"]]
        self.board.reset(int(state["step"]))
        self.saved = int(state["step"])  # what is on disk past it was saved before the roll-back: stale
        self.outbox.load_codec_state(state.get("codecs", {}))
        set_rng_state(state, self.stage.device)
        self.compute.reset(self.step)
        self.last_update = None
        self.compute.restore(self.checkpoints.file(step))
        for name, part in self.parts.items():
            if name not in state:
                raise StageError(f"checkpoint {self.checkpoints.file(step)} has no {name} state: it was written by "
                                 f"a job without it; start {self.stage.context.name} from an empty workdir")
            part.load_state_dict(state[name])

    def final(self) -> None:
        """The job's end: its last state saved, the ledger written beside the checkpoints."""
        if self.step not in self.checkpoints.steps():
            self.save()
        (self.workdir / "ledger.json").write_text(json.dumps({"steps": self.ledger}))
        # the process's peak memory: what a schedule's bound on activations in flight shows up in
        self.metrics.event("finished", step=self.step,
                           peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))

    def link_down(self, exc: LinkDown) -> LinkDown:
        """Another site stayed unreachable: the job stops; what to do, and where it resumes from."""
        return LinkDown(f"{exc}; the job stops. Once the link is back, start its stages again: they resume from "
                        f"the newest checkpoint every stage holds ({self.stage.context.name}'s newest: "
                        f"{self.newest()})")

    def newest(self) -> Path:
        """This stage's newest good checkpoint."""
        return self.checkpoints.file(max(self.good_checkpoints(), default=0))

    def good_checkpoints(self) -> list[int]:
        """Steps of the checkpoints that match their checksum (a corrupt one is skipped, with a warning)."""
        return self.checkpoints.verified_steps(self.warn)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr, flush=True)
        self.metrics.event("warning", message=text)
