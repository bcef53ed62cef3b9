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

A sharded round (`exchange = "sharded"`: a reduce-scatter then an all-gather) splits the fragment into R
slices, slice i averaged by replica i (or, where this replica counts i absent, by the next present one):
each replica sends slice i of its pseudo-gradient to that owner only; an owner averages its slice over the
parts that arrived by half the deadline and sends the mean, with its contributors, to every present
replica, which applies the slices' means it got by the deadline. A slice whose mean did not arrive keeps
its anchor, momentum and live weights (its progress goes into the next round's pseudo-gradient). Every
receiver of a mean decodes the same bits and hashes the same contributors into its chain, so replicas that
got the same means hold the same state, and those that did not see it from the chain and fetch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

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
    # a sharded round: slice -> its owner as this replica saw them at the send; the slices it averaged
    owners: list[int] = field(default_factory=list)
    means: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    posted: bool = False  # its means are sent
    late: list[int] = field(default_factory=list)  # present replicas whose part of its slices did not arrive


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
    # (fragment, version, chain[, "part" | "mean", slice]) -> replica -> its pseudo-gradient (or slice, or mean)
    arrived: dict[tuple, dict[int, Any]] = field(default_factory=dict)
    refused: set[tuple[int, int, int]] = field(default_factory=set)  # (fragment, version, replica): not awaited
    behind: dict[int, int] = field(default_factory=dict)  # fragment -> a replica whose state beats ours
    # restored just before a send that an earlier incarnation may have made: fragment -> the weights it sent
    sent_before: dict[int, torch.Tensor] = field(default_factory=dict)
    settled: set[int] = field(default_factory=set)  # such fragments that took another's state instead
    _best: dict[int, tuple] = field(default_factory=dict)  # fragment -> how far `behind`'s replica is
    slices: list[list[tuple[int, int]]] = field(default_factory=list)  # sharded: fragment -> R (start, end)

    # -- what arrives --------------------------------------------------------------------------------------
    def check(self, replica: int, fragment: int, tensors: Mapping[str, torch.Tensor], what: str,
              part: int | None = None) -> str | None:
        """Why a pseudo-gradient or state (`what`: the tensors it must carry, each a flat vector of the
        fragment's size, or of slice `part`'s) must be refused, or None."""
        if replica not in self.peers:
            return f"replica {replica} is not another replica of this job (it has {self.replica_count})"
        if self.peers[replica].refused:
            return f"replica {replica} is left out: {self.peers[replica].refused}"
        if not 0 <= fragment < len(self.fragments):
            return f"fragment {fragment} does not exist (this stage has {len(self.fragments)})"
        if sorted(tensors) != sorted(what.split()):
            return f"it carries tensors {sorted(tensors)}, not {what.split()}"
        if part is not None and not (self.slices and 0 <= part < len(self.slices[fragment])):
            return f"slice {part} does not exist (this job's exchange is not sharded, or has fewer replicas)"
        size = self.sizes[fragment] if part is None else self.slices[fragment][part][1] - self.slices[fragment][part][0]
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != (size,):
                return f"{name} has shape {tuple(tensor.shape)}, not ({size},) (fragment {fragment})"
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

    def offer(self, replica: int, fragment: int, version: int, chain: str, weight: int, grad: Any,
              share: tuple[str, int] | None = None) -> str:
        """A checked pseudo-gradient of `replica` (or, sharded, `share` = ("part", i): its slice i, or
        ("mean", i): its mean of slice i, with the contributors): -> "kept", "twice", "stale" (our state is
        ahead: it missed a round or went another way) or "ahead" (theirs is: kept for after we fetch it)."""
        state = self.states[fragment]
        self.heard(replica)
        if self.compare(replica, fragment, version, chain, weight):
            verdict = "ahead"
        elif (version, chain) != (state.version, state.chain):
            self.refused.add((fragment, version, replica))
            return "stale"
        else:
            verdict = "kept"
        got = self.arrived.setdefault((fragment, version, chain, *(share or ())), {})
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

    # -- a sharded round ---------------------------------------------------------------------------------
    def owners(self) -> list[int]:
        """Slice i's owner: replica i, or the next present one after it where i is not (this replica is)."""
        here = set(self.present()) | {self.replica}
        count = self.replica_count
        return [next(j % count for j in range(i, i + count) if j % count in here) for i in range(count)]

    def _shares(self, fragment: int) -> tuple[OuterState, Pending, list[tuple[int, int, int]]]:
        """The fragment's state, its round in flight and its non-empty slices: (i, start, end)."""
        state, pending = self.states[fragment], self.pending[fragment]
        return state, pending, [(i, lo, hi) for i, (lo, hi) in enumerate(self.slices[fragment]) if hi > lo]

    def awaited_parts(self, fragment: int) -> list[int]:
        """The present replicas whose part of a slice this replica averages has not arrived."""
        state, pending, slices = self._shares(fragment)
        mine = [i for i, _, _ in slices if pending.owners[i] == self.replica]
        return sorted({j for i in mine for j in self.present() if (fragment, state.version, j) not in self.refused
                       and j not in self.arrived.get((fragment, state.version, state.chain, "part", i), {})})

    def awaited_means(self, fragment: int) -> list[int]:
        """The present owners whose mean of their slice has not arrived."""
        state, pending, slices = self._shares(fragment)
        present = set(self.present())
        return sorted({o for i, _, _ in slices if (o := pending.owners[i]) in present
                       and o not in self.arrived.get((fragment, state.version, state.chain, "mean", i), {})})

    def mean_of(self, fragment: int) -> dict[int, tuple[torch.Tensor, list[int]]]:
        """Slice -> (mean, contributors) of each slice this replica averages: its own part and those that
        arrived, in replica order; notes the present replicas whose part is late."""
        state, pending, slices = self._shares(fragment)
        pending.late = self.awaited_parts(fragment)
        found = {}
        for i, lo, hi in slices:
            if pending.owners[i] == self.replica:
                got = {**self.arrived.get((fragment, state.version, state.chain, "part", i), {}),
                       self.replica: pending.own[lo:hi]}
                found[i] = (average(got), sorted(got))
        return found

    def decide_sharded(self, fragment: int, params: Mapping[str, torch.Tensor]) -> Decision:
        """Apply the slices' means that arrived (and this replica's own): see the module's docstring."""
        state, pending, slices = self._shares(fragment)
        gradient, shares, missing = torch.zeros_like(state.anchor), [], set(pending.late)
        for i, lo, hi in slices:
            owner = pending.owners[i]
            got = pending.means.get(i) if owner == self.replica else \
                self.arrived.get((fragment, state.version, state.chain, "mean", i), {}).get(owner)
            if got is None:
                missing.add(owner)
            else:
                gradient[lo:hi] = got[0]
            shares.append((lo, hi, [] if got is None else list(got[1])))
        missing &= set(self.present())
        for j in missing:
            self.peers[j].present = False
        contributors = sorted({j for _, _, who in shares for j in who})
        self.pending.pop(fragment)
        unreached = [(lo, hi) for lo, hi, who in shares if not who]
        live = flatten(params, self.fragments[fragment]) if unreached else None
        self.outer.step(state, gradient, contributors, shares)
        self._place(fragment, params, state.anchor, pending, None)
        if live is not None:  # a slice none reached: its live weights stay as they were
            now = flatten(params, self.fragments[fragment])
            for lo, hi in unreached:
                now[lo:hi] = live[lo:hi]
            write_back(params, self.fragments[fragment], now)
        self._forget(fragment)
        return Decision(fragment, state.version, contributors, sorted(missing))

    @property
    def replica_count(self) -> int:
        return len(self.peers) + 1

    def present(self) -> list[int]:
        return [j for j, peer in self.peers.items() if peer.present and not peer.refused]

    def absent(self) -> list[int]:
        return [j for j, peer in self.peers.items() if not peer.present and not peer.refused]

    @classmethod
    def of(cls, replica: int, peers: Mapping[int, str], params: Mapping[str, torch.Tensor],
           fragments: Iterable[list[str]], outer: OuterOptimizer, sharded: bool = False) -> Exchange:
        """Version 0 of every fragment: the anchors are the weights as they are now."""
        fragments = list(fragments)
        states = [OuterState(flatten(params, names)) for names in fragments]
        sizes = [int(s.anchor.numel()) for s in states]
        slices = [_slices(n, len(peers) + 1) for n in sizes] if sharded else []
        return cls(replica, {j: Peer(a) for j, a in peers.items()}, fragments, sizes, outer, states, slices=slices)


def _slices(size: int, count: int) -> list[tuple[int, int]]:
    """`count` contiguous slices of [0, size), the first size % count one element longer."""
    bounds = [i * (size // count) + min(i, size % count) for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))
