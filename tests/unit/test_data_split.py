"""The package-held-out split: whole packages in valid/test, and nothing held out leaks into train."""
import pytest

from nebula.errors import ConfigError, DataError
from services.corpus.pair import Pair
from services.corpus.split import split_by_package, unique_sources


def corpus() -> list[Pair]:
    """Ten packages; every package repeats a few common UI strings, as real catalogs do."""
    pairs = []
    for k in range(10):
        package = f"pkg{k}"
        pairs += [Pair(package, "Abrir", "Open"), Pair(package, "Cancelar", "Cancel")]
        pairs += [Pair(package, f"frase {k} {i}", f"sentence {k} {i}") for i in range(10 + 5 * k)]
    # the same English with another Spanish rendering, in a package of its own
    pairs.append(Pair("pkg9", "Abra", "Open"))
    return pairs


def test_whole_packages_are_held_out_and_disjoint():
    split = split_by_package(corpus(), seed=0, valid_fraction=0.1, test_fraction=0.1)
    test_pk = {p.package for p in split.test}
    valid_pk = {p.package for p in split.valid}
    train_pk = {p.package for p in split.train}
    assert test_pk == set(split.test_packages) and valid_pk == set(split.valid_packages)
    assert not test_pk & valid_pk and not test_pk & train_pk and not valid_pk & train_pk


def test_no_held_out_source_or_target_appears_in_train():
    split = split_by_package(corpus(), seed=0, valid_fraction=0.1, test_fraction=0.1)
    held_src = {p.src for p in split.test + split.valid}
    held_tgt = {p.tgt for p in split.test + split.valid}
    assert split.train
    assert not any(p.src in held_src or p.tgt in held_tgt for p in split.train)
    assert not any(p.src in {t.src for t in split.test} for p in split.valid)
    # the shared UI strings went with the held-out packages, not into train
    assert not any(p.tgt in ("Open", "Cancel") for p in split.train)


def test_split_is_deterministic_and_seeded():
    a = split_by_package(corpus(), seed=3)
    b = split_by_package(corpus(), seed=3)
    assert a == b
    assert any(split_by_package(corpus(), seed=s).test_packages != a.test_packages for s in range(10))


def test_sources_are_unique_within_each_split():
    split = split_by_package(corpus(), seed=1, valid_fraction=0.2, test_fraction=0.2)
    for part in split.parts().values():
        assert len({p.src for p in part}) == len(part)
    assert unique_sources([Pair("a", "x", "1"), Pair("b", "x", "2")]) == [Pair("a", "x", "1")]


def test_bad_fractions_and_too_few_packages_are_rejected():
    with pytest.raises(ConfigError, match="test_fraction"):
        split_by_package(corpus(), test_fraction=0.7)
    with pytest.raises(DataError, match="at least 3 packages"):
        split_by_package([Pair("a", "x", "y"), Pair("b", "u", "v")])
