"""Which examples each step trains on: a pure function of (seed, step), so every site agrees and a
resumed job neither skips nor repeats an example. The ledger records what each applied step used.

With [replicas], replica k of R reads only its shard, the examples k, k + R, k + 2R, ... of the split
(torch's DistributedSampler's split of a data set), in an order of its own that is again a pure function
of (seed, step): a resumed replica neither skips nor repeats, and R replicas' step t together take R x
batch_size distinct examples, as R data-parallel ranks of one global batch would."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Sequence

import torch
import xxhash

from nebula.errors import DataError

if TYPE_CHECKING:  # the stage module reads its own examples: a type only
    from nebula.runtime.stage import Stage


def id_hash(example_id: str) -> int:
    """Signed 64-bit hash of an example id: what crosses the WAN instead of the id text."""
    return xxhash.xxh3_64_intdigest(example_id.encode()) - (1 << 63)


def id_hashes(example_ids: Sequence[str]) -> torch.Tensor:
    """(N,) int64 hashes of `example_ids`."""
    return torch.tensor([id_hash(i) for i in example_ids], dtype=torch.int64)


class ExampleOrder:
    """Epoch-wise shuffled order over `n` examples (or over shard k of R of them: the examples k, k + R,
    ...); step s takes the next `batch_size` of them."""

    def __init__(self, n: int, batch_size: int, seed: int, shard: tuple[int, int] = (0, 1)):
        k, count = shard
        self.positions = range(k, n, count)  # the examples this order draws from
        if not self.positions:
            raise DataError(f"{n} examples cannot be split over {count} replicas: replica {k} would have none")
        self.n, self.batch_size, self.seed = len(self.positions), batch_size, seed
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
            out.append(self.positions[int(self._permutation(pos // self.n)[pos % self.n])])
        return out


def digest(id_hashes: list[int]) -> str:
    """Order-free fingerprint of the examples one step trained on."""
    ordered = torch.tensor(sorted(id_hashes), dtype=torch.int64)
    return hashlib.sha256(ordered.numpy().tobytes()).hexdigest()[:16]


class Examples:
    """A stage's examples as the runtime sees them: each split's id hashes (read from the stage once) and,
    at a source, which of them each training step takes."""

    def __init__(self, stage: Stage, job: Any):
        self.stage, self.job = stage, job
        self._hashes: dict[str, torch.Tensor] = {}
        self._order: ExampleOrder | None = None

    def hashes(self, split: str) -> torch.Tensor:
        if split not in self._hashes:
            self._hashes[split] = id_hashes(self.stage.examples(split))
        return self._hashes[split]

    def forget(self, split: str) -> None:
        """The stage's `split` changed (e.g. `nebula translate`'s next input): read its ids again."""
        self._hashes.pop(split, None)

    def of_step(self, step: int) -> tuple[torch.Tensor, list[int]]:
        """(the training split's hashes, the indices of step `step`'s examples)."""
        hashes = self.hashes("train")
        if self._order is None:
            if not len(hashes):
                raise DataError(f"stage {self.stage.context.name} has no training examples: check its data "
                                f"({self.job.data})")
            train, replicas = self.job.train, self.job.replicas
            shard = (self.job.replica, replicas.count) if replicas is not None else (0, 1)
            self._order = ExampleOrder(len(hashes), train.batch_size, train.seed, shard)
        return hashes, self._order.indices(step)
