"""The outer optimiser of replicas (DiLoCo, Douillard et al. 2023): what a round does with the replicas'
pseudo-gradients, apart from how they travel (nebula.runtime.replicas). No sockets, no runner.

Each replica trains H inner steps with its stage's own optimiser from the *anchor* (the outer weights at
the round's start), then sends its pseudo-gradient, anchor - weights now. The average of those that arrived
is the outer gradient g, and SGD with Nesterov momentum applies it to the anchor:

    m <- mu m + g        anchor <- anchor - lr (g + mu m)        (heavy-ball "sgd": anchor - lr m)

DiLoCo's defaults are lr = 0.7, mu = 0.9; with lr = 1 and mu = 0 the new anchor is the replicas' mean.

Streaming DiLoCo (Douillard et al. 2025) splits the parameters into fragments, each with its own anchor,
momentum and rounds, synchronised at staggered steps (`Fragments`): the bytes of a round are spread over
the H steps instead of one burst, and a fragment's exchange can run under the next inner steps.

A fragment travels and is kept as one flat float32 vector (its parameters in the module's order,
`flatten`): one tensor per message whatever the model, and a codec sees the whole fragment (top-k picks
its largest values over all of it).

`version` counts a fragment's completed rounds; `chain` digests the history of who contributed to each
(so two replicas whose histories differ see it from one number), `weight` is the number of
contributions in that history. Replicas in the same state hold equal (version, chain) and equal tensors:
every one of them averages the same decoded pseudo-gradients, in replica order.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

import torch

from nebula.runtime.replica_set import OuterConfig


def flatten(params: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The fragment's parameters as one float32 vector on the CPU, (sum of their sizes,)."""
    return torch.cat([params[n].detach().reshape(-1).to("cpu", torch.float32) for n in names])


def write_back(params: Mapping[str, torch.Tensor], names: list[str], flat: torch.Tensor) -> None:
    """Copy a fragment's vector into the live parameters (each on its device, in its dtype)."""
    offset = 0
    with torch.no_grad():
        for name in names:
            param = params[name]
            n = param.numel()
            param.copy_(flat[offset:offset + n].view_as(param).to(param.device, param.dtype))
            offset += n


def split_fragments(sizes: Mapping[str, int], count: int) -> list[list[str]]:
    """The parameters (name -> element count, in the module's order) in `count` contiguous fragments of
    about equal size: a parameter goes to the next fragment when more than half of it would lie past the
    current one's share (a fragment is never empty: at most as many as there are parameters)."""
    names = list(sizes)
    count = max(1, min(count, len(names)))
    total = sum(sizes.values())
    fragments: list[list[str]] = [[] for _ in range(count)]
    done, k = 0, 0
    for i, name in enumerate(names):
        left = len(names) - i  # every later fragment still needs one parameter
        past = done + sizes[name] / 2 > total * (k + 1) / count
        if fragments[k] and (past or left <= count - 1 - k) and k < count - 1:
            k += 1
        fragments[k].append(name)
        done += sizes[name]
    return fragments


@dataclass
class OuterState:
    """One fragment's outer state: what every replica holds the same of it after each round."""

    anchor: torch.Tensor  # the outer weights, flat: where this round's inner steps began
    momentum: torch.Tensor | None = None
    version: int = 0  # rounds completed
    chain: str = "0" * 16  # digest of the contributors of every round so far
    weight: int = 0  # contributions averaged so far, over all rounds

    def ahead_of(self, version: int, chain: str, weight: int) -> bool:
        """Whether this state wins over another replica's (version, chain, weight): further on, or as far
        with more contributions, or as many with the smaller chain (any total order that every replica
        computes alike would do: the loser fetches the winner's state)."""
        return (self.version, self.weight, _neg(self.chain)) > (version, weight, _neg(chain))

    def state_dict(self) -> dict:
        return {"version": self.version, "chain": self.chain, "weight": self.weight, "anchor": self.anchor.clone(),
                "momentum": None if self.momentum is None else self.momentum.clone()}

    @classmethod
    def from_dict(cls, saved: Mapping) -> OuterState:
        momentum = saved["momentum"]
        return cls(saved["anchor"].clone(), None if momentum is None else momentum.clone(), int(saved["version"]),
                   str(saved["chain"]), int(saved["weight"]))


def _neg(chain: str) -> tuple[int, ...]:
    """A chain compared so that the smaller hex digest wins."""
    return tuple(-ord(c) for c in chain)


def next_chain(chain: str, version: int, contributors: list[int], shares: list[list[int]] | None = None) -> str:
    """`shares` (a sharded round): each slice's contributors, which may differ from slice to slice."""
    who = ','.join(map(str, sorted(contributors))) if shares is None else \
        ';'.join(','.join(map(str, sorted(s))) for s in shares)
    return hashlib.sha256(f"{chain}|{version}|{who}".encode()).hexdigest()[:16]


def average(contributions: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The mean of the replicas' pseudo-gradients, summed in replica order (every replica gets the same bits)."""
    order = sorted(contributions)
    total = contributions[order[0]].to(torch.float32).clone()
    for replica in order[1:]:
        total += contributions[replica].to(torch.float32)
    return total / len(order)


class OuterOptimizer:
    def __init__(self, config: OuterConfig):
        self.lr, self.mu, self.nesterov = config.lr, config.momentum, config.name == "nesterov"

    def step(self, state: OuterState, gradient: torch.Tensor, contributors: list[int],
             shares: list[tuple[int, int, list[int]]] | None = None) -> None:
        """Apply the averaged pseudo-gradient `gradient` to the anchor (as torch.optim.SGD with momentum,
        dampening 0, does to a parameter); the round is complete. `shares` (a sharded round): each slice
        (start, end, its contributors); a slice that none reached keeps its anchor and momentum."""
        g = gradient.to(torch.float32)
        kept = [(lo, hi, state.anchor[lo:hi].clone(), None if state.momentum is None else state.momentum[lo:hi].clone())
                for lo, hi, who in shares or [] if not who]
        state.momentum = g.clone() if state.momentum is None else state.momentum.mul_(self.mu).add_(g)
        update = g + self.mu * state.momentum if self.nesterov else state.momentum
        state.anchor.sub_(self.lr * update)
        for lo, hi, anchor, momentum in kept:  # not averaged this round: as if the round had not touched it
            state.anchor[lo:hi] = anchor
            state.momentum[lo:hi] = 0 if momentum is None else momentum
        state.chain = next_chain(state.chain, state.version, contributors,
                                 None if shares is None else [who for _, _, who in shares])
        state.version += 1
        state.weight += len(contributors) if shares is None else sum(len(who) for _, _, who in shares)
