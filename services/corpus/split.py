"""Train / valid / test with whole packages held out, and no held-out string leaking into training.

Software strings repeat across packages ("Open", "Cancel", "could not open file"), so a random split by line
would put most test sentences in train too. Instead whole packages go to test (and other whole packages to
valid), chosen by a seeded shuffle so that each takes about its fraction of the pairs; then every pair whose
source or target text appears in a held-out split is removed from the splits before it.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from nebula.errors import ConfigError, DataError
from services.corpus.pair import Pair


@dataclass(frozen=True)
class Split:
    train: list[Pair]
    valid: list[Pair]
    test: list[Pair]
    valid_packages: list[str]
    test_packages: list[str]

    def parts(self) -> dict[str, list[Pair]]:
        return {"train": self.train, "valid": self.valid, "test": self.test}


def split_by_package(
    pairs: list[Pair], *, seed: int = 0, valid_fraction: float = 0.05, test_fraction: float = 0.05
) -> Split:
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0 < value < 0.5:
            raise ConfigError(f"{name}={value} is out of range: use a fraction between 0 and 0.5, e.g. 0.05")
    sizes = Counter(p.package for p in pairs)
    if len(sizes) < 3:
        raise DataError(f"need pairs from at least 3 packages to hold some out, got {sorted(sizes)}")
    rng = random.Random(seed)
    test_packages = _hold_out(sizes, test_fraction, rng, exclude=set())
    valid_packages = _hold_out(sizes, valid_fraction, rng, exclude=set(test_packages))
    test = unique_sources([p for p in pairs if p.package in test_packages])
    valid = unique_sources(_without([p for p in pairs if p.package in valid_packages], test))
    rest = [p for p in pairs if p.package not in test_packages and p.package not in valid_packages]
    train = unique_sources(_without(rest, test + valid))
    if not train:
        raise DataError("every pair went to valid or test: lower the held-out fractions")
    return Split(train, valid, test, valid_packages, test_packages)


def _hold_out(sizes: Counter, fraction: float, rng: random.Random, *, exclude: set[str]) -> list[str]:
    """Packages, in seeded random order, taken while they fit within `fraction` of all pairs.

    At least one package is always taken (the smallest, if none fits) and at least one left for train.
    """
    candidates = sorted(p for p in sizes if p not in exclude)
    rng.shuffle(candidates)
    budget = fraction * sum(sizes.values())
    chosen, taken = [], 0
    for package in candidates[:-1]:
        if taken + sizes[package] <= budget:
            chosen.append(package)
            taken += sizes[package]
    return sorted(chosen) or [min(candidates, key=lambda p: (sizes[p], p))]


def _without(pairs: list[Pair], held_out: list[Pair]) -> list[Pair]:
    """`pairs` minus those sharing their source or their target text with a held-out pair."""
    sources = {p.src for p in held_out}
    targets = {p.tgt for p in held_out}
    return [p for p in pairs if p.src not in sources and p.tgt not in targets]


def unique_sources(pairs: list[Pair]) -> list[Pair]:
    """Keep the first pair for each source text: one reference per source, no repeated training examples."""
    seen: set[str] = set()
    kept = []
    for pair in pairs:
        if pair.src not in seen:
            seen.add(pair.src)
            kept.append(pair)
    return kept
