"""Services forked from the supervisor's zygote (nebula.site.zygote) are what a cold start makes: real
processes under the real supervisor, a cold start of the same spec beside each."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

from nebula.site.process import proc_stat
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]


def probe(run: Path, name: str, *args: str, fork: bool = True, zygote: str = "1", **kw) -> ServiceSpec:
    """A service printing what it sees; NEBULA_ZYGOTE set, whatever the suite runs with."""
    return ServiceSpec(name=name, argv=(sys.executable, "-m", "tests.support.zygote_probe", *args), run=run, cwd=REPO,
                       env={"PROBE": name, "OMP_NUM_THREADS": "2", "NEBULA_ZYGOTE": zygote}, fork=fork, **kw)


def seen(spec: ServiceSpec) -> list[dict]:
    """What each start of `spec` printed about itself."""
    return [json.loads(line) for line in spec.log.read_text().splitlines() if line.startswith("{")]


def run_all(supervisor: Supervisor, specs: list[ServiceSpec], timeout: float = 60) -> None:
    for spec in specs:
        supervisor.start(spec)
    supervisor.run(lambda: all(supervisor.services[s.name].state in ("done", "failed") for s in specs),
                   timeout=timeout)


def test_a_forked_service_sees_what_a_cold_one_sees(tmp_path):
    warm, cold = probe(tmp_path, "warm", "exit", "0"), probe(tmp_path, "cold", "exit", "0", fork=False)
    with Supervisor(strict=False) as supervisor:
        run_all(supervisor, [warm, cold])
    [w], [c] = seen(warm), seen(cold)
    assert w.pop("warm") and not c.pop("warm")  # torch was imported before the forked one began
    assert w.pop("probe") == "warm" and c.pop("probe") == "cold"  # its own environment
    for facts in (w, c):
        facts.pop("pid"), facts.pop("random")
    assert w == c == {"session_leader": True, "cwd": str(REPO), "path0": str(REPO), "threads": 2,
                      "argv": ["exit", "0"]}


def test_each_forked_child_draws_its_own_random_numbers(tmp_path):
    specs = [probe(tmp_path, f"p{i}", "exit", "0") for i in range(2)]
    with Supervisor(strict=False) as supervisor:
        run_all(supervisor, specs)
    assert seen(specs[0])[0]["random"] != seen(specs[1])[0]["random"]


def test_exit_codes_crashes_kills_and_restarts_reach_the_supervisor_as_from_a_cold_process(tmp_path):
    failing = [probe(tmp_path, "three", "exit", "3"), probe(tmp_path, "bug", "raise")]
    with Supervisor(strict=False) as supervisor:
        run_all(supervisor, failing + [dataclasses.replace(s, name=f"{s.name}-cold", fork=False) for s in failing])
        codes = {name: s.exit_code for name, s in supervisor.services.items()}
        assert codes == {"three": 3, "bug": 1, "three-cold": 3, "bug-cold": 1}
        assert "RuntimeError: the probe's own bug" in failing[1].log.read_text()  # the traceback, in its log

        sleeper = supervisor.start(probe(tmp_path, "sleeper", "sleep", restart=True))
        first = sleeper.proc.pid
        supervisor.run(lambda: len(seen(sleeper.spec)) == 1, timeout=30)  # up, then killed
        supervisor.kill("sleeper")
        assert sleeper.proc.returncode == -9
        supervisor.run(lambda: sleeper.state == "running" and sleeper.proc.pid != first, timeout=30)
        supervisor.run(lambda: len(seen(sleeper.spec)) == 2, timeout=30)  # the restart printed too
        assert seen(sleeper.spec)[1]["warm"]
        zygote = supervisor.zygote.proc
    assert zygote.returncode == 0  # stop() ended the zygote with its services
    assert sleeper.state == "stopped"


def test_nebula_zygote_0_starts_every_service_cold(tmp_path):
    spec = probe(tmp_path, "p", "exit", "0", zygote="0")
    with Supervisor(strict=False) as supervisor:
        run_all(supervisor, [spec])
    assert not seen(spec)[0]["warm"] and supervisor.zygote is None


def test_a_zygote_that_dies_leaves_its_services_running_and_the_next_start_gets_a_new_one(tmp_path):
    with Supervisor(strict=False) as supervisor:
        sleeper = supervisor.start(probe(tmp_path, "sleeper", "sleep", restart=True))
        supervisor.run(lambda: len(seen(sleeper.spec)) == 1, timeout=30)
        first = supervisor.zygote.proc
        first.kill()  # the OOM killer, say
        first.wait()
        supervisor.poll()
        assert sleeper.state == "running" and sleeper.proc.poll() is None  # reparented, still serving
        supervisor.kill("sleeper")
        assert sleeper.proc.returncode == -9  # its code was the dead zygote's to tell: counted as a crash
        supervisor.run(lambda: len(seen(sleeper.spec)) == 2, timeout=60)
        assert seen(sleeper.spec)[1]["warm"] and supervisor.zygote.proc is not first


def test_a_zygote_killed_right_after_a_fork_still_hands_over_the_child_it_forked(tmp_path):
    with Supervisor(strict=False) as supervisor:
        first = supervisor.start(probe(tmp_path, "first", "sleep"))
        zygote = supervisor.zygote
        second = probe(tmp_path, "second", "sleep")
        zygote.ask(second.argv[2:], second.cwd, second.environment(supervisor.env, 0, None), second.rank_log(0))
        assert select.select([zygote.proc.stdout], [], [], 60)[0]  # its answer is written...
        zygote.proc.kill()  # ...and it dies before the supervisor reads it
        zygote.proc.wait()
        pid = zygote.started(("second",), time.monotonic() + 60)
        try:
            assert proc_stat(pid) is not None  # the child it forked, running, not left unwatched
        finally:
            os.killpg(pid, signal.SIGKILL)
        supervisor.kill("first")
        assert first.proc.returncode == -9


def test_a_start_whose_zygote_dies_under_it_starts_cold_and_says_so(tmp_path):
    with Supervisor(strict=False) as supervisor:
        supervisor.start(probe(tmp_path, "first", "sleep"))
        zygote = supervisor.zygote.proc
        os.kill(zygote.pid, signal.SIGSTOP)  # alive, but it will never answer: it dies while asked
        threading.Timer(1.0, zygote.kill).start()
        cold = supervisor.start(probe(tmp_path, "cold", "print"))
        supervisor.run(lambda: cold.state == "done", timeout=60)
        assert not seen(cold.spec)[0]["warm"]
        # "did not start ..." once asked; a broken pipe if a loaded host let the kill come first
        assert "starting it cold" in cold.spec.log.read_text()
        warm = supervisor.start(probe(tmp_path, "warm", "print"))  # the next start: a new zygote
        supervisor.run(lambda: warm.state == "done", timeout=60)
        assert seen(warm.spec)[0]["warm"] and supervisor.zygote.proc is not zygote
