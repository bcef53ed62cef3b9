"""Whole jobs as real processes: each site built and its gateway and stages started as `nebula site up`
does (nebula.site.local: the site builder, the sites' service specs, the one supervisor), CURVE on every
socket, loopback only (the e2e tests' `start_job` fixture, tests/e2e/conftest.py, starts
and stops them). Also the tiny job file, the ledger each stage must end with, and metrics records."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import tomllib

from nebula.runtime.job import JobConfig, load_job
from nebula.runtime.job_file import write_job_file
from nebula.runtime.metrics import read_records
from nebula.runtime.order import ExampleOrder, digest, id_hash
from nebula.site.local import start_sites
from nebula.site.supervisor import Supervisor

E2E = Path(__file__).resolve().parents[1] / "e2e"
TINY = E2E / "jobs" / "tiny.toml"
JOB_TIMEOUT = 150.0  # one tiny job takes ~30 s on 2 busy cores, ~45 s with a restart


def write_job(root: Path, replace: dict[str, str] | None = None) -> Path:
    """tests/e2e/jobs/tiny.toml (ABNet) with the data path made absolute and `replace` (old -> new) applied."""
    text = TINY.read_text().replace('data = "../data/es-en"', f'data = "{E2E / "data" / "es-en"}"')
    return _write(root, text, replace, TINY.name)


def job_file(root: Path, name: str, replace: dict[str, str] | None = None) -> Path:
    """tests/e2e/jobs/`name`.toml as `root`/job.toml, with `replace` (old -> new, each must occur) applied."""
    return _write(root, (E2E / "jobs" / f"{name}.toml").read_text(), replace, f"{name}.toml")


def _write(root: Path, text: str, replace: dict[str, str] | None, name: str) -> Path:
    """`text` with `replace` applied, written by the one writer of job files (so checked as it will load)."""
    path = root / "job.toml"
    write_job_file(path, tomllib.loads(replaced(text, replace, name)))
    return path


def replaced(text: str, replace: dict[str, str] | None, name: str) -> str:
    """`text` with `replace` (old -> new, each must occur in the file `name`) applied."""
    for old, new in (replace or {}).items():
        assert old in text, f"{old!r} is not in {name}"
        text = text.replace(old, new)
    return text


def example_ledger(job: JobConfig, repeat: int = 1) -> list[list]:
    """What each step must have trained on at a stage of the example workload fed by `repeat` sources
    (each with the same example order)."""
    n = job.stage(job.graph.sources[0]).options.examples
    hashes = [id_hash(f"train:{i}") for i in range(n)]
    order = ExampleOrder(n, job.train.batch_size, job.train.seed)
    return [[s, digest([hashes[i] for i in order.indices(s)] * repeat)] for s in range(1, job.train.steps + 1)]


def expected_ledger(job: JobConfig) -> list[list]:
    """What each step of an ABNet job must have trained on: the schedule over the train ids, as the stages
    digest it."""
    ids = (Path(job.data) / "train.ids").read_text(encoding="utf-8").split("\n")[:-1]
    hashes = [id_hash(i) for i in ids]
    order = ExampleOrder(len(ids), job.train.batch_size, job.train.seed)
    return [[s, digest([hashes[i] for i in order.indices(s)])] for s in range(1, job.train.steps + 1)]


def terminate_once_training(argv: list[str], run: Path) -> None:
    """Start the command `argv` that runs sites in `run`; once its decoder has trained a step, SIGTERM
    it (a `timeout`, a `kill`, a container stop) and assert it stopped every process of `run`."""
    command = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not any("loss" in r for r in records(run / "decoder" / "metrics.jsonl", "step")):
            assert time.monotonic() < deadline and command.poll() is None, "the sites did not start"
            time.sleep(0.5)
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=60) != 0
    finally:
        command.kill()
    left = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of {run} still running: {left}"


def records(path: Path, kind: str | None = None) -> list[dict]:
    """Every record of a metrics or audit file (or those of one kind)."""
    return read_records(path, kind)


class Sites:
    """One job on its local sites; the test drives supervision (`poll`) so it can inject faults."""

    def __init__(self, run: Path, job_file: Path, restart: bool = True, max_restarts: int = 3,
                 skip: tuple[str, ...] = (), channel: dict[str, float] | None = None):
        self.run, self.job_file, self.job = run, job_file, load_job(job_file)
        self.stages = {name: stage.address for name, stage in self.job.instances().items()}  # replicas' too
        self.group: Supervisor = start_sites(run, job_file, restart=restart, skip=skip, channel=channel)
        self.group.max_restarts = max_restarts

    def steps(self, stage: str) -> int:
        done = records(self.run / stage / "metrics.jsonl", "step")
        return done[-1]["step"] if done else 0

    def finished(self) -> bool:
        return all(self.group.services[name].finished() for name in self.stages)

    def wait(self, until=None, timeout: float = JOB_TIMEOUT, what: str = "the job to finish") -> None:
        """Supervise (restarts with backoff; StageError with the log tail if a service gives up)
        until `until()` holds, by default until every stage exited successfully."""
        self.group.run(until or self.finished, timeout=timeout, what=what, interval=0.1)

    def kill(self, stage: str) -> None:
        self.group.kill(stage)

    def ledger(self, stage: str) -> list[list]:
        """[step, digest of its examples] for each step `stage` applied, in order."""
        return json.loads((self.run / stage / "ledger.json").read_text())["steps"]

    def resumed(self, stage: str) -> list[int]:
        """The checkpoint steps `stage` resumed from, the first (0) included."""
        return [r["step"] for r in records(self.run / stage / "metrics.jsonl") if r.get("event") == "resumed"]

    def restarts(self, stage: str) -> int:
        return self.group.services[stage].restarts

    def log(self, service: str) -> str:
        return (self.run / "logs" / f"{service}.log").read_text(errors="replace")

    def tails(self, lines: int = 25) -> str:
        return self.group.tails(lines)

    def stop(self) -> None:
        self.group.stop()
