"""What a stage receives, and what it says while it waits: whom it needs a message from, and for how long.

A stage waits up to its timeout for its next message; a WAN outage the channel reports holds that clock
(the channel's own wan_timeout bounds an outage), and so does a time the process itself was stopped. Every
WAIT_NOTICE_S it tells the operator whom it waits for, on stderr and in its metrics; with data-parallel
ranks it wakes often enough to hear that one of them failed.
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable

from nebula.errors import PeerFailed, RecvTimeout, StageError
from nebula.runtime.compute import Compute
from nebula.runtime.metrics import MetricsLog
from nebula.transport.base import Channel
from nebula.wire import Kind, Message

REFUSED = "refused"  # the ERROR code of a tensor refused by its receiver (nebula.runtime.integrity)

if TYPE_CHECKING:  # the runner hands them in: types only
    from nebula.runtime.board import Board
    from nebula.runtime.coordinator import Role
    from nebula.runtime.outbox import Outbox

WAIT_NOTICE_S = 10.0  # a stage that has received nothing for this long says whom it waits for, and again as often
RANK_CHECK_S = 0.5  # a stage with ranks looks this often whether one of them failed
STOPPED_S = 1.0  # a receive that returns this much later than asked: the process was stopped, not its peers silent


class Inbox:
    def __init__(self, channel: Channel, name: str, addresses: dict[str, str], metrics: MetricsLog, timeout: float,
                 compute: Compute, ranks: bool, awaited: Callable[[], list[str]],
                 interrupt: Callable[[], None] = lambda: None):
        """`interrupt`: called as often as `compute.check` while it waits (what another thread found that
        must stop the wait: a rank's bad output, which raises or asks for an abort)."""
        self.channel, self.name, self.addresses, self.metrics = channel, name, addresses, metrics
        self.timeout, self.compute, self.ranks, self.awaited = timeout, compute, ranks, awaited
        self.interrupt = interrupt
        self.names = {address: n for n, address in addresses.items()}

    def sender(self, msg: Message, job: str) -> str:
        """The stage of job `job` that sent `msg`; one from no stage of it, or of another job (or of none:
        every stage names its job), is an error of this stage's."""
        sender = self.names.get(msg.src)
        if sender is None:
            raise StageError(f"{msg.src} sent a {msg.kind.name} message but is not a stage of job {job}")
        if msg.job != job:
            raise StageError(f"{msg.src} sent a message of job {msg.job!r} to a stage of job {job!r}: submit every "
                             "site's half of a job under the id the first site issued "
                             "(`nebula job submit JOB.toml --join ID`)")
        return sender

    def recv(self, deadline: float | None = None) -> Message | None:
        """The next message; None once `deadline` (time.monotonic()) has passed without one: an outer round
        of replicas waits for the others only so long (nebula.runtime.replicas)."""
        started = clock = noticed = time.monotonic()  # the timeout runs from `clock`, held while a site is down
        # with ranks, wake often enough to hear that one failed (its relay records it): a stage waiting for a
        # peer would otherwise learn it only at the next notice, 10 s later
        slice_s = RANK_CHECK_S if self.ranks else WAIT_NOTICE_S
        while True:
            self.compute.check()
            self.interrupt()
            left = self.timeout - (time.monotonic() - clock)
            until = left if deadline is None else min(left, deadline - time.monotonic())
            if deadline is not None and until <= 0:
                return None
            wait, asked = max(0.0, min(slice_s, until)), time.monotonic()
            try:
                msg = self.channel.recv(timeout=wait)
                break
            except RecvTimeout as exc:
                outages = self.channel.outages()
                now = time.monotonic()
                if now - asked - wait > STOPPED_S:  # the wait overran: this process did not run (SIGSTOP, a Slurm
                    clock += now - asked  # job suspended, `docker pause`) for part of it, not known which: the
                    continue  # wait counts for nothing, and the peers' messages may be queued already
                if outages:  # a WAN outage: the channel's wan_timeout bounds it, not this wait
                    clock = now
                elif left <= slice_s:
                    raise RecvTimeout(f"{self.name}: no message within {self.timeout:g} s; it was waiting for "
                                      f"{self.awaited_text()}") from exc
                if now - noticed >= WAIT_NOTICE_S - 1e-3:
                    noticed = now
                    self._waiting(now - started, outages)
        if msg.kind == Kind.ERROR and msg.error_code == REFUSED:
            return msg  # a peer refused a tensor of this stage's: its step is aborted, the job goes on
        if msg.kind == Kind.ERROR:  # gateways' refusals are handled by the channel: this is a stage's
            raise PeerFailed(msg.error_code, f"{msg.src} failed: {msg.error_message}; fix the cause there, "
                                             "then restart the job's stages")
        return msg

    def _waiting(self, waited: float, outages: dict[str, float]) -> None:
        """The line an operator sees while this stage gets nothing (a peer down, restarting, or slow,
        or a site unreachable)."""
        stages = self.awaited()
        down = "".join(f"; site {site} unreachable for {s:.0f} s" for site, s in sorted(outages.items()))
        print(f"[{self.metrics.label}] waiting for {self.awaited_text(stages)} since {waited:.0f} s{down}",
              file=sys.stderr, flush=True)
        self.metrics.event("waiting", echo=False, stages=stages, since_s=round(waited, 1),
                           **({"unreachable_s": {k: round(v, 1) for k, v in outages.items()}} if outages else {}))

    def awaited_text(self, stages: list[str] | None = None) -> str:
        stages = self.awaited() if stages is None else stages
        return ", ".join(f"{s} ({self.addresses[s]})" for s in stages) or "messages from the other stages"


def awaited(role: Role, board: Board, outbox: Outbox, last: int) -> list[str]:
    """The stages whose messages a stage needs next (best effort, for the waiting line): those a resume
    waits for, those its next step lacks, those the end waits for, else its first in-link's peer."""
    for found in (role.awaited_resume(), board.awaited(last), role.awaited_end()):
        if found is not None:
            return found
    return [outbox.in_links[0].peer] if outbox.in_links and board.applied + 1 not in board.open else []
