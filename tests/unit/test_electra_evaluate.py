"""The encoder evaluation orders two cheap real encoders as it should: hashed character trigrams (es and en
UI strings share numbers, %s and product names) far above chance, seeded noise at chance. Every number is
reproducible and inside its interval; missing data is a DataError that says how to build it.

Retrieval runs on the tiny corpus in tests/e2e/data (one package in its test split); the probe needs several
held-out packages, so the orderings use tests/fixtures/electra_eval: 60 real test sentences of each of the 4
largest packages of the prepared corpora (cut by its make.py), so they run where no `nebula data prepare` did."""
import zlib
from functools import cache
from pathlib import Path

import pytest
import torch

from nebula.errors import ConfigError, DataError
from services.corpus.corpus import ParallelSide, write_split
from services.corpus.pair import Pair
from services.electra.evaluate import bootstrap, evaluate_all, format_table, probe, retrieval

TESTS = Path(__file__).resolve().parents[1]
TINY = TESTS / "e2e" / "data"
DATA = TESTS / "fixtures" / "electra_eval"
N = 150  # retrieval candidates: fewer than either pair holds, so the seed picks which


def hashing(texts: list[str], dim: int = 512) -> torch.Tensor:
    """L2-normalised counts of character trigrams hashed into `dim` buckets (crc32: stable across runs)."""
    out = torch.zeros(len(texts), dim)
    for row, text in enumerate(texts):
        padded = f" {text.lower()} "
        for i in range(len(padded) - 2):
            out[row, zlib.crc32(padded[i:i + 3].encode()) % dim] += 1
    return torch.nn.functional.normalize(out, dim=1)


def noise(texts: list[str], dim: int = 512) -> torch.Tensor:
    """Gaussian noise seeded by the texts: deterministic, and unlike a seed fixed per call it does not give
    the i-th source chunk and the i-th English chunk the same rows (which would be perfect 'retrieval')."""
    g = torch.Generator().manual_seed(zlib.crc32("\n".join(texts).encode()))
    return torch.randn(len(texts), dim, generator=g)


@cache
def real(encoder: str, pair: str) -> tuple[dict, dict]:
    """(retrieval, probe) on the held-out packages of tests/fixtures/electra_eval, once per encoder and pair."""
    encode = {"hashing": hashing, "noise": noise}[encoder]
    return retrieval(encode, DATA, pair, n=N), probe(encode, DATA, pair)


def assert_in_interval(row: dict) -> None:
    lo, hi = row["interval"]
    assert 0 <= lo <= row["accuracy"] <= hi <= 1, row


def test_bootstrap_interval():
    assert bootstrap([0.5] * 20, seed=0) == (0.5, 0.5)
    values = [1.0] * 30 + [0.0] * 70
    lo, hi = bootstrap(values, seed=3)
    assert 0.2 <= lo < 0.3 < hi <= 0.4
    assert bootstrap(values, seed=3) == (lo, hi) != bootstrap(values, seed=4)
    with pytest.raises(DataError, match="empty"):
        bootstrap([], seed=0)


def test_retrieval_on_the_tiny_corpus():
    good, bad = retrieval(hashing, TINY, "es-en"), retrieval(noise, TINY, "es-en")
    assert good["n"] == bad["n"] == 32 and good["chance"] == 1 / 32
    assert good["accuracy"] > 5 * good["chance"]
    assert good["interval"][0] > bad["accuracy"]
    for row in (good, bad):
        assert_in_interval(row)
    assert retrieval(hashing, TINY, "es-en") == good


def test_probe_on_three_tiny_packages(tmp_path):
    pairs = []
    for split in ("train", "valid", "test"):
        src, tgt = ParallelSide(TINY / "es-en" / split, "src"), ParallelSide(TINY / "es-en" / split, "tgt")
        pairs += [Pair(i.split(":")[0], s, t) for i, s, t in zip(src.ids, src.lines, tgt.lines)]
    write_split(tmp_path / "es-en" / "test", pairs)
    row = probe(hashing, tmp_path, "es-en")
    assert row["classes"] == ["apt", "audacity-data", "dpkg"] and row["chance"] == 1 / 3
    assert row["train_n"] == row["test_n"] > 0 and row["test_n"] % 3 == 0
    assert_in_interval(row)
    assert probe(hashing, tmp_path, "es-en") == row
    assert probe(hashing, tmp_path, "es-en", n_per_class=4)["train_n"] == 12


def test_probe_needs_several_packages():
    with pytest.raises(DataError, match="at least 2 packages.*apt 32"):
        probe(hashing, TINY, "es-en")


@pytest.mark.parametrize("pair", ["es-en", "zh-en"])
def test_hashing_beats_noise_on_held_out_packages(pair):
    (good_r, good_p), (bad_r, bad_p) = real("hashing", pair), real("noise", pair)
    assert good_r["n"] == bad_r["n"] == N and good_r["chance"] == 1 / N
    assert good_r["accuracy"] > 5 * good_r["chance"] > bad_r["accuracy"]
    assert good_r["interval"][0] > bad_r["accuracy"]
    assert good_p["classes"] == bad_p["classes"] == sorted(good_p["classes"]) and len(good_p["classes"]) >= 3
    assert good_p["english_accuracy"] > 1.5 * good_p["chance"]
    assert good_p["accuracy"] > good_p["chance"]
    assert bad_p["interval"][0] < bad_p["chance"] < bad_p["interval"][1]
    for row in (good_r, good_p, bad_r, bad_p):
        assert_in_interval(row)


def test_real_results_are_deterministic():
    first = real("hashing", "es-en")
    assert (retrieval(hashing, DATA, "es-en", n=N), probe(hashing, DATA, "es-en")) == first
    assert retrieval(hashing, DATA, "es-en", n=N, seed=1) != first[0]


def test_missing_data_says_how_to_build_it(tmp_path):
    for call in (lambda: retrieval(hashing, tmp_path, "es-en"), lambda: probe(hashing, tmp_path, "es-en")):
        with pytest.raises(DataError, match="nebula data prepare") as err:
            call()
        assert str(tmp_path / "es-en") in str(err.value)
    with pytest.raises(DataError, match="nebula data prepare") as err:
        evaluate_all(hashing, tmp_path)
    assert str(tmp_path) in str(err.value)


def test_an_encoder_of_the_wrong_shape_is_refused():
    with pytest.raises(ConfigError, match=r"shape \(32, H\)"):
        retrieval(lambda texts: torch.zeros(len(texts)), TINY, "es-en")


def test_table_calls_better_only_when_the_intervals_separate():
    def row(task, acc, lo, hi):
        return {"task": task, "pair": "es-en", "accuracy": acc, "interval": [lo, hi], "chance": 0.25}

    before = [row("retrieval", 0.1, 0.05, 0.15), row("probe", 0.3, 0.25, 0.35)]
    after = [row("retrieval", 0.5, 0.45, 0.55), row("probe", 0.4, 0.34, 0.46)]
    lines = format_table(before, after).splitlines()
    assert lines[0].split() == ["task", "pair", "chance", "untrained", "pre-trained", "better"]
    assert lines[1].split()[-1] == "yes" and lines[2].split()[-1] == "no"
    assert "0.500 [0.450, 0.550]" in lines[1]
    assert len({line.index("0.") for line in lines[1:]}) == 1  # columns line up


def test_alignment_shuffle_keeps_the_source_length():
    """The shuffled source of the alignment test has the true one's length wherever another has it, so the
    English half sits at the same positions in both rows; never the pair's own source; seeded."""
    from services.electra.heldout import derangement
    lengths = [int(x) for x in torch.randint(1, 30, (500,), generator=torch.Generator().manual_seed(3))]
    other = derangement(lengths, seed=1)
    assert sorted(other) == list(range(500)) and all(other[i] != i for i in range(500))
    assert all(lengths[other[i]] == lengths[i] for i in range(500))  # every length occurs more than once here
    assert derangement(lengths, seed=1) == other and derangement(lengths, seed=2) != other
    single = [4, 4, 4, 5, 9, 9]  # 5 has no partner: it takes the nearest run's, and only two items differ
    pairs = derangement(single, seed=0)
    assert all(pairs[i] != i for i in range(6)) and sorted(pairs) == list(range(6))
    assert sum(single[pairs[i]] != single[i] for i in range(6)) <= 2
    assert derangement([7, 3], seed=0) == [1, 0]
