"""The supervisor with real processes: backoff that blocks no one, exit 3 never retried, nothing left behind;
waiting for a service to serve, the foreground loop, the detach-and-wait; a process's identity."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nebula.errors import ConfigError, StageError
from nebula.site.ports import ephemeral_low, free_port
from nebula.site.process import ProcessId, alive, children
from nebula.site.service import ServiceSpec
from nebula.site.supervisor import Supervisor, detach, run_command, stop_signals


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def service(name: str, code: str, run, **kw) -> ServiceSpec:
    """A service running python `code`; its log is run/logs/<name>.log."""
    return ServiceSpec(name=name, argv=python(code), run=run, **kw)


def run_until(supervisor: Supervisor, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, {s.name: s.describe() for s in supervisor.services.values()}
        supervisor.poll()
        time.sleep(0.02)


def test_a_service_in_backoff_holds_up_no_other(tmp_path):
    sup = Supervisor(strict=False, state_file=tmp_path / "state.json")
    crasher = sup.start(service("crasher", "raise SystemExit(1)", tmp_path, restart=True))
    run_until(sup, lambda: crasher.restarts == 3 and crasher.state == "backoff")  # the next wait is 4 s
    worker = sup.start(service("worker", "import time; time.sleep(0.3)", tmp_path))
    run_until(sup, lambda: worker.state == "done")
    assert crasher.state == "backoff" and crasher.restarts == 3  # the worker finished inside the crasher's backoff
    run_until(sup, lambda: crasher.restarts == 4)
    assert '"restarts": 4' in (tmp_path / "state.json").read_text()
    sup.stop()


def test_exit_3_is_never_restarted_and_strict_mode_says_why(tmp_path):
    lenient = Supervisor(strict=False)
    s = lenient.start(service("bad-config", "raise SystemExit(3)", tmp_path, restart=True))
    run_until(lenient, lambda: s.state == "failed")
    assert (s.exit_code, s.restarts) == (3, 0)
    strict = Supervisor()
    strict.start(service("bad-config", "print('no such key'); raise SystemExit(3)", tmp_path,
                         restart=True))
    with pytest.raises(StageError, match=r"(?s)bad-config failed: a fix is needed first \(exit 3\).*no such key"):
        run_until(strict, lambda: False, timeout=10)


def test_ranks_fail_and_restart_together(tmp_path):
    sup = Supervisor(strict=False)
    code = "import os, time; time.sleep(0.2); raise SystemExit(1 if os.environ['RANK'] == '1' else 0)"
    s = sup.start(service("disc", code, tmp_path, restart=True, ranks=2))
    first = [p.pid for p in s.procs]
    run_until(sup, lambda: s.restarts == 1)
    assert len(s.procs) == 2 and not {p.pid for p in s.procs} & set(first)
    assert (tmp_path / "logs" / "disc.rank1.log").exists()
    sup.stop()


def test_stop_leaves_no_process_behind(tmp_path):
    sup = Supervisor()
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " print(c.pid, flush=True); time.sleep(60)")
    s = sup.start(service("parent", code, tmp_path))
    run_until(sup, lambda: (tmp_path / "logs" / "parent.log").read_text().strip() != "")
    child = int((tmp_path / "logs" / "parent.log").read_text().split()[0])
    sup.stop(timeout=5)
    assert s.state == "stopped" and not alive(s.proc.pid)
    deadline = time.monotonic() + 5  # the grandchild got SIGKILL; the kernel may take a moment under load
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_service_that_recovered_starts_its_backoff_over(tmp_path, monkeypatch):
    from nebula.site import supervisor
    monkeypatch.setattr(supervisor, "STABLE_S", 0.3)  # "recovered" after 0.3 s up, not 30 s
    sup = Supervisor(strict=False, max_restarts=2)
    s = sup.start(service("flaky", "import time; time.sleep(0.5); raise SystemExit(1)", tmp_path,
                          restart=True))
    run_until(sup, lambda: s.restarts == 4)  # more than max_restarts crashes in all, each after a stable run
    assert s.state in ("running", "backoff") and s.streak == 1
    sup.stop()


def test_free_ports_are_below_the_ephemeral_range_bindable_and_never_handed_out_twice():
    """A port from bind(0) is ephemeral, so another process's outgoing connection could take it as its
    source port before the service binds it: a CI run of the chaos test failed so."""
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200 and all(1024 <= p < ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_two_processes_picking_ports_at_once_never_get_the_same_one():
    """Picked, not yet bound: without a host-wide claim, 300 picks each from the 10,000 ports below the range
    would share ~9 (a 3-worker run of the suite once failed on one)."""
    code = "from nebula.site.ports import free_port; print(*[free_port() for _ in range(300)])"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    picked = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert len(picked[0]) == len(picked[1]) == 300 and not picked[0] & picked[1]


def test_ready_waits_for_the_log_of_the_latest_start_and_names_a_service_that_died_first(tmp_path):
    sup = Supervisor(strict=False)
    code = "import time; time.sleep(0.3); print('serving', flush=True); time.sleep(60)"
    s = sup.start(service("server", code, tmp_path, ready="serving"))
    assert sup.ready("server", timeout=20) is s and "serving" in s.log.read_text()
    sup.kill("server")
    sup.start(service("server", code, tmp_path, ready="serving"))  # the log says it already: not this start
    started = time.monotonic()
    sup.ready("server", timeout=20)
    assert time.monotonic() - started >= 0.25
    sup.start(service("dies", "print('no such key'); raise SystemExit(3)", tmp_path, ready="serving"))
    with pytest.raises(StageError, match=r"(?s)dies did not come up \(it exited\).*no such key"):
        sup.ready("dies", timeout=20)
    sup.stop()


def test_the_foreground_loop_stops_when_asked_and_names_what_it_waited_for(tmp_path):
    sup = Supervisor(strict=False)
    s = sup.start(service("sleeper", "import time; time.sleep(60)", tmp_path))
    rounds = []
    sup.run(lambda: len(rounds) >= 3, each=lambda: rounds.append(1), interval=0.01)
    with pytest.raises(StageError, match="timed out after 0 s waiting for the sleeper to finish"):
        sup.run(s.finished, timeout=0.2, what="the sleeper to finish", interval=0.01)
    sup.stop()
    assert run_command(service("three", "raise SystemExit(3)", tmp_path)) == 3


def test_stop_signals_notes_sigterm_instead_of_dying():
    before = signal.getsignal(signal.SIGTERM)
    with stop_signals() as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not caught and time.monotonic() < deadline:
            time.sleep(0.01)
    assert caught == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before


def test_detach_returns_once_ready_and_kills_what_never_came_up(tmp_path):
    up = detach(service("up", "import time; print('serving', flush=True); time.sleep(60)", tmp_path,
                        ready="serving"), "the up service", timeout=20)
    try:
        assert up.poll() is None and os.getpgid(up.pid) == up.pid  # its own session and process group
    finally:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()
    with pytest.raises(ConfigError, match=r"(?s)the stuck service did not come up \(not within 1 s\).*starting"):
        detach(service("stuck", "import time; print('starting', flush=True); time.sleep(60)", tmp_path,
                       ready="serving"), "the stuck service", timeout=1)


def test_a_process_is_its_pid_and_start_time_a_reused_pid_is_not_it(tmp_path):
    me = ProcessId.mine()
    assert me.alive() and ProcessId.parse(str(me)) == me and ProcessId.parse("12 x") is None
    stranger = ProcessId(me.pid, me.started + 1)  # the same pid, started at another time: another process
    assert not stranger.alive() and not stranger.kill_group()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    held = ProcessId.of(child.pid)
    assert held.alive() and held.pid in children(os.getpid())
    assert held.kill_group()
    child.wait()
    assert not held.alive() and held.pid not in children(os.getpid())
