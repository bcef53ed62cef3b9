"""A setting against its reference over several seeds, scored on the same held-out sentences.

One seed per setting cannot separate a codec's cost from seed noise (docs/bench-wan.md: the same
job scored 10.20 and 10.23 on one split, 15.71 and 14.65 on another). Here every seed trains the
reference and the setting, both score the same sentences, and the difference is averaged over seeds.

Scores are corpus-level (BLEU is not a mean of sentence scores), so a scenario gives per-sentence
sufficient statistics (rows of an array) and the function that scores their column sums. The
interval resamples both sources of noise at once: seeds with replacement, and sentences with
replacement (the same draw for both sides of every pair: a paired bootstrap, as sacrebleu's
--paired-bs). A second interval, Student's t over the per-seed differences, uses seeds alone: with
3 seeds it is wide, and it is the one that does not assume the seeds seen are all there are.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np

Score = Callable[[np.ndarray], float]  # column sums of per-sentence statistics -> score
RESAMPLES = 1000
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass(frozen=True)
class SeedComparison:
    per_seed: list[float]  # setting - reference, one per seed, in seed order
    mean: float
    interval: tuple[float, float]  # 95%, bootstrap over seeds and sentences
    t_interval: tuple[float, float] | None  # 95%, Student's t over seeds (None for one seed)


def compare(reference: list[np.ndarray], setting: list[np.ndarray], score: Score,
            resamples: int = RESAMPLES, seed: int = 0) -> SeedComparison:
    """`reference[i]` and `setting[i]`: seed i's per-sentence statistics (sentences x stats), the
    same sentences in the same order for every seed and both sides."""
    if not reference or len(reference) != len(setting):
        raise ValueError(f"need the same seeds on both sides, got {len(reference)} and {len(setting)}")
    n = reference[0].shape[0]
    if any(a.shape[0] != n or b.shape[0] != n for a, b in zip(reference, setting)):
        raise ValueError("every seed must score the same sentences on both sides")
    per_seed = [score(b.sum(0)) - score(a.sum(0)) for a, b in zip(reference, setting)]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        seeds = rng.integers(0, len(per_seed), len(per_seed))
        rows = rng.integers(0, n, n)
        draws.append(statistics.fmean(score(setting[s][rows].sum(0)) - score(reference[s][rows].sum(0))
                                      for s in seeds))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    mean = statistics.fmean(per_seed)
    return SeedComparison(per_seed, mean, (float(lo), float(hi)), t_interval(per_seed))


def t_interval(values: list[float]) -> tuple[float, float] | None:
    if len(values) < 2:
        return None
    half = T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    mean = statistics.fmean(values)
    return mean - half, mean + half
