"""One service spec: what a supervised service is (argv, environment, ranks, restart policy, what its
log says once it serves) and where it writes, under its run directory:

    <run>/logs/<name>.log           its output (rank r > 0 of a stage: <name>.rank<r>.log)
    <run>/status/<name>.json        what it reports itself (nebula.observe: NEBULA_STATUS_FILE points here)

A stage with `ranks = N` is N processes with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), started, failed and restarted together.
nebula.site.site makes the specs of a site's gateway and stages; nebula.site.supervisor runs them.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def nebula_argv(*args: str) -> tuple[str, ...]:
    """The command line of `nebula ARGS` in a child process, with this process's interpreter."""
    return (sys.executable, "-m", "nebula.cli", *args)


@dataclass(frozen=True, kw_only=True)
class ServiceSpec:
    name: str
    argv: tuple[str, ...]
    run: Path  # logs/ and status/ go here
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    ranks: int = 1
    restart: bool = False  # restarted with backoff when it dies unsuccessfully (never after exit 3)
    ready: str | None = None  # a text its log shows once it serves (None: serving once started)
    cwd: Path | None = None
    fork: bool = False  # argv `python -m MODULE ...`, forked from the supervisor's zygote (nebula.site.zygote)

    @property
    def log(self) -> Path:
        return self.rank_log(0)

    def rank_log(self, rank: int) -> Path:
        return self.run / "logs" / (f"{self.name}.log" if rank == 0 else f"{self.name}.rank{rank}.log")

    @property
    def status_file(self) -> Path:
        return self.run / "status" / f"{self.name}.json"

    def environment(self, base: dict[str, str], rank: int = 0, master_port: int | None = None) -> dict[str, str]:
        """The environment of rank `rank`: `base`, the spec's own variables, where it reports, and for
        a service of several ranks torchrun's variables (rank 0 listens on `master_port`)."""
        env = {**base, **self.env, "NEBULA_SERVICE": self.name, "NEBULA_STATUS_FILE": str(self.status_file)}
        if self.ranks > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                       LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
        return env


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log, or "(no log)"."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:] if lines > 0 else [])  # -0: all
    except OSError:
        return "(no log)"


def follow(paths: list[Path], interval: float = 0.5) -> None:
    """Print what `paths` gain from now on, each line prefixed with its log's name when there are
    several (`site logs -f`, `job logs -f`); until interrupted. A log that appears later (a stage
    not started yet) is followed from its first line."""
    offsets = {p: p.stat().st_size if p.exists() else 0 for p in paths}
    while True:
        for p in paths:
            if not p.exists():
                continue
            with open(p, "rb") as f:
                f.seek(offsets[p])
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written waits for the next round
            offsets[p] += len(complete)
            prefix = f"{p.stem}: " if len(paths) > 1 else ""
            for line in complete.decode(errors="replace").splitlines():
                print(prefix + line, flush=True)
        time.sleep(interval)
