"""Which examples each step trains on: a pure function of (seed, step), so every site agrees and a
resumed job neither skips nor repeats an example. The ledger records what each applied step used."""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import xxhash


def id_hash(example_id: str) -> int:
    """Signed 64-bit hash of an example id: what crosses the WAN instead of the id text."""
    return xxhash.xxh3_64_intdigest(example_id.encode()) - (1 << 63)


def id_hashes(example_ids: Sequence[str]) -> torch.Tensor:
    """(N,) int64 hashes of `example_ids`."""
    return torch.tensor([id_hash(i) for i in example_ids], dtype=torch.int64)


class ExampleOrder:
    """Epoch-wise shuffled order over `n` examples; step s takes the next `batch_size` of them."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.n, generator=gen)
        return self._order

    def indices(self, step: int) -> list[int]:
        """Example indices of step `step` (1-based steps, as counted by the optimizer)."""
        start = (step - 1) * self.batch_size
        out = []
        for pos in range(start, start + self.batch_size):
            out.append(int(self._permutation(pos // self.n)[pos % self.n]))
        return out


def digest(id_hashes: list[int]) -> str:
    """Order-free fingerprint of the examples one step trained on."""
    ordered = torch.tensor(sorted(id_hashes), dtype=torch.int64)
    return hashlib.sha256(ordered.numpy().tobytes()).hexdigest()[:16]
