"""Paired bootstrap of a metric's change, for "did pre-training help?" with an interval that can say no.

Two models scored on the same held-out items (sequences, translation pairs) are compared on the same
resamples of those items, so the item-to-item variation that both share cancels out of the interval of
their difference (unpaired intervals of each would overlap long after the change is clear). With
several training seeds, each seed's untrained and pre-trained model are a pair, and the interval is that
of the mean change over the seeds, every seed scored on the same resamples. That interval resamples items,
not seeds: it says how sure the mean of these seeds is, not how another seed would come out. So beside it
goes an interval over seeds, Student's t over the per-seed changes (with 3 seeds it is wide; it is the one
that does not take the seeds seen for all there are), and the verdict over seeds is read from it.

A metric is a callable from item weights (R, n), the multiplicity of each item in each of R resamples,
to R values; with weights of ones it is the metric itself.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from nebula.errors import DataError

Metric = Callable[[torch.Tensor], torch.Tensor]
RESAMPLES = 1000
# Student's t, 97.5% quantile by degrees of freedom (seeds - 1); past 30, the normal's 1.96 is within 2%
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}
CHUNK = 64  # resamples per pass of the AUC, which holds (CHUNK, tokens) weights


def resample_weights(n: int, resamples: int, seed: int) -> torch.Tensor:
    """(resamples, n) float64: how often each of n items is drawn in each resample with replacement."""
    if n < 2:
        raise DataError(f"{n} held-out items: a bootstrap interval needs at least 2")
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(n, (resamples, n), generator=g)
    ones = torch.ones(draws.shape, dtype=torch.float64)
    return torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(1, draws, ones)


class Ratio:
    """sum(hits) / sum(counts) over the items: an accuracy over tokens grouped by their sequence (hits and
    counts per sequence), or over pairs (counts of one)."""

    def __init__(self, hits: torch.Tensor, counts: torch.Tensor | None = None):
        self.hits = hits.double()
        self.counts = torch.ones_like(self.hits) if counts is None else counts.double()

    def __call__(self, weights: torch.Tensor) -> torch.Tensor:
        return (weights @ self.hits) / (weights @ self.counts).clamp(min=1e-12)


class Auc:
    """ROC-AUC of scores (T,) against 0/1 labels (T,) of tokens that belong to items `item` (T,): the
    chance that a positive outscores a negative, a tie counting one half (Mann-Whitney), each token
    weighted by its item's multiplicity."""

    def __init__(self, scores: torch.Tensor, labels: torch.Tensor, item: torch.Tensor):
        order = scores.double().argsort()
        self.group = torch.unique_consecutive(scores.double()[order], return_inverse=True)[1]  # ties share a group
        self.groups = int(self.group.max()) + 1 if len(order) else 0
        self.labels, self.item = labels.double()[order], item[order]

    def __call__(self, weights: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._auc(weights[i:i + CHUNK]) for i in range(0, len(weights), CHUNK)])

    def _auc(self, weights: torch.Tensor) -> torch.Tensor:
        w = weights[:, self.item]  # (R, T)
        pos = torch.zeros(len(w), self.groups, dtype=torch.float64).index_add_(1, self.group, w * self.labels)
        neg = torch.zeros(len(w), self.groups, dtype=torch.float64).index_add_(1, self.group, w * (1 - self.labels))
        below = neg.cumsum(1) - neg  # negatives scored lower than each group
        return (pos * (below + 0.5 * neg)).sum(1) / (pos.sum(1) * neg.sum(1)).clamp(min=1e-12)


def compare(before: Sequence[Metric], after: Sequence[Metric], n: int, seed: int,
            resamples: int = RESAMPLES) -> dict:
    """before[s] and after[s]: seed s's two models (or a baseline and a model) scored on the same n items.
    -> the values per seed, the mean change, its 95% paired interval over items and a verdict: "better" or
    "worse" when the interval excludes 0, else "within"; with 2 seeds or more, the 95% t interval over the
    per-seed changes and its verdict (`seed_verdict`)."""
    if len(before) != len(after) or not before:
        raise DataError(f"{len(before)} models before and {len(after)} after: compare them in pairs, one per seed")
    ones = torch.ones(1, n, dtype=torch.float64)
    old = [float(m(ones)[0]) for m in before]
    new = [float(m(ones)[0]) for m in after]
    weights = resample_weights(n, resamples, seed)
    changes = torch.stack([a(weights) - b(weights) for b, a in zip(before, after)]).mean(0)  # (R,)
    lo, hi = torch.quantile(changes, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    per_seed = [a - b for b, a in zip(old, new)]
    over_seeds = t_interval(per_seed)
    return {"before": old, "after": new, "change": statistics.fmean(per_seed), "interval": [lo, hi], "n": n,
            "verdict": verdict(lo, hi), "seed_changes": per_seed, "seed_spread": [min(per_seed), max(per_seed)],
            "seed_interval": over_seeds, "seed_verdict": None if over_seeds is None else verdict(*over_seeds)}


def verdict(lo: float, hi: float) -> str:
    return "better" if lo > 0 else "worse" if hi < 0 else "within"


def t_interval(values: list[float]) -> list[float] | None:
    """95% Student's t interval of the mean of `values` (one per seed); None for fewer than 2."""
    if len(values) < 2:
        return None
    df = len(values) - 1
    t = T975.get(df) or T975[max(k for k in T975 if k <= df)]  # the next lower df: a little wider, never narrower
    half = t * statistics.stdev(values) / len(values) ** 0.5
    mean = statistics.fmean(values)
    return [mean - half, mean + half]
