"""Which process is which: a pid with its start time, and the one reader of /proc.

A pid alone names whatever process holds it now; Linux hands pids out again, and a container's PID 1
comes back on every restart. A pid with the start time of its process (clock ticks since boot,
field 22 of /proc/PID/stat) names one process only: what pid files, job records and the
supervisor's state file store, so that `site down`, `job stop` and `site status` never signal or
trust a stranger that reuses the number.

    me = ProcessId.mine()          # str(me) == "41877 982113": what a pid file holds
    ProcessId.parse(text).alive()  # False once that process is gone, even if the pid came back
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def _read(pid: int | str, name: str) -> bytes | None:
    """/proc/PID/NAME; None where /proc has no answer (no such process, no right to read it, no /proc)."""
    try:
        return (PROC / str(pid) / name).read_bytes()
    except OSError:
        return None


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 of proc(5), the state, is [0])."""
    raw = _read(pid, "stat")
    if raw is None or b")" not in raw:
        return None
    return raw.decode(errors="replace").rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None if it is gone or a zombie (exited)."""
    fields = proc_stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def cmdline(pid: int) -> list[str] | None:
    """The process's argv ([] for an exiting process, which has dropped it); None if it is gone."""
    raw = _read(pid, "cmdline")
    return None if raw is None else [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` (VmRSS); 0 if it is gone."""
    for line in (_read(pid, "status") or b"").decode(errors="replace").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of `pid` in clock ticks (fields 14 and 15 of proc(5)); None if it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[11]) + int(fields[12])


def children(parent: int) -> set[int]:
    """The live (not zombie) processes whose parent is `parent`."""
    found = set()
    for entry in os.listdir(PROC):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is not None and fields[1] == str(parent) and fields[0] != "Z":
                found.add(int(entry))
    return found


def alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs on this host (and, given `started`, is still the process that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = start_time(pid)
    if now is None:
        return not (PROC / "self" / "stat").exists()  # no /proc at all: kill(0) is all we know
    return started is None or now == started


@dataclass(frozen=True)
class ProcessId:
    """One process: its pid and when it started (None: not known, e.g. a record from before start
    times were kept; then only the pid is checked)."""

    pid: int
    started: int | None

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        return cls(pid, start_time(pid))

    @classmethod
    def mine(cls) -> ProcessId:
        return cls.of(os.getpid())

    @classmethod
    def parse(cls, text: str) -> ProcessId | None:
        """"PID START" as str() writes it; None for anything else."""
        try:
            pid, started = text.split()
            return cls(int(pid), int(started))
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.pid} {self.started}"

    def alive(self) -> bool:
        return alive(self.pid, self.started)

    def kill_group(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the process group this process leads (every service starts its own), if the process
        is still this one; -> whether it was."""
        if not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True
