"""Stage processes forked from a warm interpreter (a zygote) instead of started cold.

A stage spends ~3.5 s of CPU importing torch and torch._dynamo (every optimizer step imports it) before
it does any work (one core of an AMD EPYC with AVX-512, 2026-12-02): the start of every stage, and of
every restart after a crash, on a host whose cores are training. A supervisor that starts a stage keeps
one zygote instead, `python -m nebula.site.zygote`, started once with the supervisor's environment: it
imports those modules and forks a child per start. The child becomes what `python -m MODULE ARGS`
(a ServiceSpec with `fork`) would be: its own session; its log on stdout and stderr, unbuffered; its
working directory, environment and thread count; fresh random seeds. It runs MODULE as `-m` does and
exits as the interpreter would (threads joined, atexit handlers run, output flushed) without tearing
its modules down, which would copy every page it shares with the zygote (~1 s of CPU).

What still differs from a cold start: a module imported by the zygote read the zygote's environment at
import (nebula reads its own variables when it parses the command line, after the fork). NEBULA_ZYGOTE=0
starts every service cold. The torch DataLoader forks its workers from a process that imported torch
in the same way.

Protocol, lines of JSON: the supervisor writes {"argv", "cwd", "env", "log"} (argv: MODULE ARGS) to its stdin; the
zygote answers {"pid"} for each and {"exited": pid, "code"} when a child ends (Popen's returncode: -N
for signal N). At EOF on its stdin (the supervisor is gone) the zygote exits; its children go on.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from nebula.site.process import proc_stat

PRELOAD = ("torch", "torch._dynamo", "nebula.site.stage_service")
START_S = 120.0  # how long the first start may wait for the zygote's imports


def enabled(env: dict[str, str]) -> bool:
    return env.get("NEBULA_ZYGOTE", "1") != "0"


@dataclass
class Forked:
    """A child of the zygote, with the part of subprocess.Popen the supervisor uses."""

    pid: int
    zygote: Zygote
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self.zygote.collect(0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode


@dataclass
class Zygote:
    """The supervisor's end: start children, learn how they ended."""

    env: dict[str, str]
    proc: subprocess.Popen | None = None
    children: dict[int, Forked] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # start replies not yet taken
    exits: dict[int, int] = field(default_factory=dict)  # codes of children not yet registered
    _buffer: bytes = b""

    def spawn(self, argv: tuple[str, ...], cwd: Path | None, env: dict[str, str], log: Path) -> Forked:
        """Fork `python ARGV` (ARGV: -m MODULE ARGS; output appended to `log`); -> the child, once forked."""
        if argv[:2] != (sys.executable, "-m"):
            raise ValueError(f"only `{sys.executable} -m MODULE ...` can be forked, not {argv[:3]}")
        if self.proc is None:  # a zygote that died is replaced (by the supervisor), not restarted
            self.proc = subprocess.Popen([sys.executable, "-m", "nebula.site.zygote"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=self.env, start_new_session=True)
            assert self.proc.stdout is not None
            os.set_blocking(self.proc.stdout.fileno(), False)
        self.ask(argv[2:], cwd, env, log)
        pid = self.started(argv[2:4], time.monotonic() + START_S)
        child = Forked(pid, self, self.exits.pop(pid, None))  # it may have ended already
        if child.returncode is None:
            self.children[pid] = child
        return child

    def ask(self, argv: tuple[str, ...], cwd: Path | None, env: dict[str, str], log: Path) -> None:
        """Request a child running `python -m ARGV` (BrokenPipeError if the zygote has died)."""
        assert self.proc is not None and self.proc.stdin is not None
        log.touch()  # there from the start, as for a cold start (the supervisor reads it at once)
        request = {"argv": list(argv), "cwd": None if cwd is None else str(cwd), "env": env, "log": str(log)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def started(self, what: tuple[str, ...], deadline: float) -> int:
        """The pid of the child the last request forked; OSError if the zygote ended without one. A zygote
        that dies right after a fork has still sent its pid (read here: the child is not left unwatched);
        one that hangs past `deadline` is killed first, so that no late fork answers a later request."""
        assert self.proc is not None and self.proc.stdout is not None
        while not self.pids:
            if self.proc.stdout.closed:  # at EOF: everything it sent is read
                raise OSError(f"the zygote did not start {' '.join(what)} (exit code {self.proc.poll()})")
            if time.monotonic() > deadline and self.proc.poll() is None:
                self.proc.kill()
            self.collect(0.5)
        return self.pids.pop(0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def collect(self, timeout: float) -> None:
        """Read what the zygote said (waiting up to `timeout` s for something)."""
        if self.proc is None or self.proc.stdout is None:
            return
        if self.proc.stdout.closed:  # it died: its children were reparented, their exit codes are lost
            self._orphaned()
            time.sleep(timeout)
            return
        out = self.proc.stdout.fileno()
        if select.select([out], [], [], timeout)[0]:
            try:
                chunk = os.read(out, 65536)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                self.proc.stdout.close()
                self._orphaned()
            self._buffer += chunk or b""
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            reply = json.loads(line)
            if "pid" in reply:
                self.pids.append(reply["pid"])
            elif reply["exited"] in self.children:
                self.children.pop(reply["exited"]).returncode = reply["code"]
            else:
                self.exits[reply["exited"]] = reply["code"]

    def _orphaned(self) -> None:
        for pid, child in list(self.children.items()):
            stat = proc_stat(pid)
            if stat is None or stat[0] == "Z":  # gone, or dead and not yet reaped by its new parent
                child.returncode = -signal.SIGKILL  # unknown: counted as a crash, so it is restarted
                del self.children[pid]

    def close(self) -> None:
        """End the zygote (its children are the supervisor's to stop)."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # it died with a request unread
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the zygote's end ---

def serve() -> dict[str, Any] | None:
    """Fork a child per request on stdin; report pids and exits on stdout. -> the request, in a child;
    None in the zygote when stdin ends."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wake-up pipe
    buffer = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            while _drain(wake_r):
                pass
            _reap()
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            led_r, led_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # before the pid is told: a signal to its group must reach it from the start
                os.close(led_w)
                os.close(led_r)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                request: dict[str, Any] = json.loads(line)
                return request
            os.close(led_w)
            os.read(led_r, 1)  # EOF once the child leads its session (or has died)
            os.close(led_r)
            _reply({"pid": pid})


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(obj: dict[str, Any]) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def become(request: dict[str, Any]) -> None:
    """Make this forked child what `python -m MODULE ARGS` started by the supervisor would be (its output
    unbuffered, as the supervisor's PYTHONUNBUFFERED asks)."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the zygote's pipes were 0 and 1: the child keeps neither
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # where `-m` looks first: the child's directory, not the zygote's
    os.environ.clear()
    os.environ.update(request["env"])
    import random

    import torch
    random.seed()  # each child its own, as a cold interpreter seeds itself
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "OMP_NUM_THREADS" in os.environ:  # OpenMP read the zygote's value when torch loaded
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def main() -> int:
    """The zygote: 0 when its supervisor has gone; a forked child never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends it (EOF), not a terminal's ^C
    for name in PRELOAD:
        __import__(name)
    request = serve()
    if request is None:
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become(request)
    module, *args = request["argv"]
    sys.argv = [module, *args]  # run_module puts the module's path first, as `-m` does
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()  # as the interpreter would, for an exception nothing caught
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
    _exit(1 if isinstance(code, str) else code or 0)


def _exit(code: int) -> NoReturn:
    """A normal exit without module teardown: that would write to (and so copy) every page the child
    shares with the zygote, ~1 s of CPU with torch loaded; the rest of an exit (threads, atexit, flushed
    output) as the interpreter does it."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
