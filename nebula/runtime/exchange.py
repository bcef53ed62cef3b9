"""The decisions of one stage's outer rounds with the same stage of the other replicas, without sockets
(nebula.runtime.replicas moves the messages; docs/replicas.md has the protocol).

A round of fragment f at version v: every replica sends its pseudo-gradient, tagged (f, v, chain, weight),
to the others it counts as present; each one averages its own and those of (f, v, the same chain) that
arrived by its deadline, in replica order, and applies the outer step (nebula.runtime.outer). So:

- a replica late past the deadline, killed or cut off is left out of that round (`missing`) and is not
  awaited again until it speaks (`present`); its late pseudo-gradient is never averaged into a later round;
- each contribution is averaged at most once: one per (replica, fragment, version), a second is refused;
- a replica that finds another's state ahead of its own (further on, or as far on another history: a
  pseudo-gradient that reached some replicas by their deadline and not others) fetches that state and
  keeps only its progress since its last send, so what it sent counts once or not at all, never twice;
- what does not fit (a replica not in the job, an unknown fragment, other parameter names, a wrong shape,
  a non-finite value) is refused with a reason, never averaged in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from nebula.runtime.outer import OuterOptimizer, OuterState, average, flatten, write_back


@dataclass
class Pending:
    """This replica's round of one fragment in flight: sent, not merged yet."""

    version: int
    step: int  # the inner step it was sent after
    started: float  # monotonic time of the send: the deadline runs from it
    own: torch.Tensor  # its own pseudo-gradient as the others decode it, flat
    sent: torch.Tensor | None = None  # the weights at the send, flat, where inner steps run before the merge
    wire_bytes: int = 0  # what its sends took on the wire, to every replica together


@dataclass
class Peer:
    address: str
    present: bool = True  # awaited in rounds: it has spoken since it last missed one
    refused: str = ""  # why it is left out for good (another graph): set from its HELLO
    hello: bool = False  # a HELLO from it since the last join began


@dataclass
class Decision:
    fragment: int
    version: int  # the version the round produced
    contributors: list[int]
    missing: list[int]  # present replicas whose pseudo-gradient did not arrive by the deadline


@dataclass
class Exchange:
    replica: int
    peers: dict[int, Peer]
    fragments: list[list[str]]  # fragment -> parameter names
    sizes: list[int]  # fragment -> its elements
    outer: OuterOptimizer
    states: list[OuterState]
    pending: dict[int, Pending] = field(default_factory=dict)
    arrived: dict[tuple[int, int, str], dict[int, torch.Tensor]] = field(default_factory=dict)
    refused: set[tuple[int, int, int]] = field(default_factory=set)  # (fragment, version, replica): not awaited
    behind: dict[int, int] = field(default_factory=dict)  # fragment -> a replica whose state beats ours
    # restored just before a send that an earlier incarnation may have made: fragment -> the weights it sent
    sent_before: dict[int, torch.Tensor] = field(default_factory=dict)
    settled: set[int] = field(default_factory=set)  # such fragments that took another's state instead
    _best: dict[int, tuple] = field(default_factory=dict)  # fragment -> how far `behind`'s replica is

    # -- what arrives --------------------------------------------------------------------------------------
    def check(self, replica: int, fragment: int, tensors: Mapping[str, torch.Tensor], what: str) -> str | None:
        """Why a pseudo-gradient or state (`what`: the tensors it must carry, each a flat vector of the
        fragment's size) must be refused, or None."""
        if replica not in self.peers:
            return f"replica {replica} is not another replica of this job (it has {self.replica_count})"
        if self.peers[replica].refused:
            return f"replica {replica} is left out: {self.peers[replica].refused}"
        if not 0 <= fragment < len(self.fragments):
            return f"fragment {fragment} does not exist (this stage has {len(self.fragments)})"
        if sorted(tensors) != sorted(what.split()):
            return f"it carries tensors {sorted(tensors)}, not {what.split()}"
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != (self.sizes[fragment],):
                return f"{name} has shape {tuple(tensor.shape)}, not ({self.sizes[fragment]},) (fragment {fragment})"
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                return f"{name} has a non-finite value (or is not floating point)"
        return None

    def heard(self, replica: int) -> None:
        peer = self.peers.get(replica)
        if peer is not None and not peer.refused:
            peer.present = True

    def compare(self, replica: int, fragment: int, version: int, chain: str, weight: int,
                other_anchor: bool = False) -> bool:
        """Note another replica's state of `fragment`; True if it beats ours (we fetch it, from the best such
        replica). `other_anchor`: at the same version and history its anchor differs (replicas that started
        apart): the lower replica's wins."""
        state = self.states[fragment]
        same = (version, chain) == (state.version, state.chain)
        apart = other_anchor and replica < self.replica
        if (same and not apart) or (not same and state.ahead_of(version, chain, weight)):
            return False
        key = (version, weight, tuple(-ord(c) for c in chain), -replica)
        if fragment not in self.behind or key > self._best[fragment]:
            self.behind[fragment], self._best[fragment] = replica, key
        return True

    def offer(self, replica: int, fragment: int, version: int, chain: str, weight: int, grad: torch.Tensor) -> str:
        """A checked pseudo-gradient of `replica`: -> "kept", "twice", "stale" (our state is ahead: it missed
        a round or went another way) or "ahead" (theirs is: kept for after we fetch it)."""
        state = self.states[fragment]
        self.heard(replica)
        if self.compare(replica, fragment, version, chain, weight):
            verdict = "ahead"
        elif (version, chain) != (state.version, state.chain):
            self.refused.add((fragment, version, replica))
            return "stale"
        else:
            verdict = "kept"
        got = self.arrived.setdefault((fragment, version, chain), {})
        if replica in got:
            return "twice"
        got[replica] = grad
        return verdict

    # -- a round -------------------------------------------------------------------------------------------
    def awaited(self, fragment: int) -> list[int]:
        """The present replicas whose pseudo-gradient for this fragment's round has not arrived."""
        state = self.states[fragment]
        got = self.arrived.get((fragment, state.version, state.chain), {})
        return [j for j, peer in self.peers.items() if peer.present and not peer.refused and j not in got
                and (fragment, state.version, j) not in self.refused]

    def decide(self, fragment: int, params: Mapping[str, torch.Tensor]) -> Decision:
        """Average our own pseudo-gradient and those that arrived, apply the outer step, and move the live
        weights onto the new anchor (with their progress since the send, where inner steps ran meanwhile)."""
        state, pending = self.states[fragment], self.pending.pop(fragment)
        assert pending.version == state.version  # adopt() drops a pending round of another version
        missing = self.awaited(fragment)
        for j in missing:
            self.peers[j].present = False
        got = {**self.arrived.pop((fragment, state.version, state.chain), {}), self.replica: pending.own}
        self.outer.step(state, average(got), sorted(got))
        self._place(fragment, params, state.anchor, pending, None)
        self._forget(fragment)
        return Decision(fragment, state.version, sorted(got), missing)

    def adopt(self, fragment: int, state: OuterState, params: Mapping[str, torch.Tensor]) -> None:
        """Take another replica's state of `fragment`; the live weights keep only their progress since our
        last send (or since our anchor, if nothing is in flight), on top of its anchor: what we sent is
        in its state once or not at all, and never added again."""
        pending = self.pending.pop(fragment, None)
        before = self.sent_before.pop(fragment, None)
        if before is not None:  # its send is moot: it took the state that send went into (or passed)
            self.settled.add(fragment)
        self._place(fragment, params, state.anchor, pending, self.states[fragment].anchor if before is None else before)
        self.states[fragment] = state
        self.behind.pop(fragment, None)
        self._forget(fragment)

    def _place(self, fragment: int, params: Mapping[str, torch.Tensor], anchor: torch.Tensor,
               pending: Pending | None, old_anchor: torch.Tensor | None) -> None:
        """Live weights <- `anchor` + their progress since the send (`pending`), or since `old_anchor`."""
        names = self.fragments[fragment]
        if pending is not None and pending.sent is None:  # no inner step since the send: nothing to keep
            write_back(params, names, anchor)
            return
        base = pending.sent if pending is not None else old_anchor
        assert base is not None  # decide() always has a pending round
        write_back(params, names, anchor + (flatten(params, names) - base))

    def _forget(self, fragment: int) -> None:
        """Arrivals and refusals of rounds this fragment has passed."""
        version = self.states[fragment].version
        for key in [k for k in self.arrived if k[0] == fragment and k[1] < version]:
            del self.arrived[key]
        self.refused = {r for r in self.refused if r[0] != fragment or r[1] >= version}

    @property
    def replica_count(self) -> int:
        return len(self.peers) + 1

    def present(self) -> list[int]:
        return [j for j, peer in self.peers.items() if peer.present and not peer.refused]

    def absent(self) -> list[int]:
        return [j for j, peer in self.peers.items() if not peer.present and not peer.refused]

    @classmethod
    def of(cls, replica: int, peers: Mapping[int, str], params: Mapping[str, torch.Tensor],
           fragments: Iterable[list[str]], outer: OuterOptimizer) -> Exchange:
        """Version 0 of every fragment: the anchors are the weights as they are now."""
        fragments = list(fragments)
        states = [OuterState(flatten(params, names)) for names in fragments]
        return cls(replica, {j: Peer(a) for j, a in peers.items()}, fragments,
                   [int(s.anchor.numel()) for s in states], outer, states)
