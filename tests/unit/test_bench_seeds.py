"""nebula_lab.bench.seeds: a setting's BLEU difference from its reference over seeds, with real sacrebleu
statistics of real sentences."""
import numpy as np
import pytest

from nebula_lab.bench.seeds import compare, t_interval
from services.abnet.bench import SCENARIO

REFS = [f"the file number {i} cannot be opened by the program" for i in range(40)]


def stats(hyps: list[str]) -> np.ndarray:
    from sacrebleu.metrics import BLEU
    return np.array(BLEU(lowercase=True)._extract_corpus_statistics(hyps, [REFS]), dtype=np.int64)


def degraded(every: int) -> list[str]:
    """The references with every `every`-th sentence cut to its first three words."""
    return [" ".join(r.split()[:3]) if i % every == 0 else r for i, r in enumerate(REFS)]


def test_scores_from_stats_match_sacrebleus_corpus_bleu():
    from sacrebleu.metrics import BLEU
    hyps = degraded(3)
    assert SCENARIO.score_stats(stats(hyps).sum(0)) == pytest.approx(
        BLEU(lowercase=True).corpus_score(hyps, [REFS]).score)


def test_the_same_translations_differ_by_nothing():
    same = [stats(degraded(4)) for _ in range(3)]
    c = compare(same, same, SCENARIO.score_stats, resamples=200)
    assert c.per_seed == [0.0, 0.0, 0.0] and c.mean == 0.0
    assert c.interval == (0.0, 0.0) and c.t_interval == (0.0, 0.0)


def test_a_worse_setting_on_every_seed_has_its_interval_below_zero():
    reference = [stats(degraded(k)) for k in (7, 8, 9)]
    setting = [stats(degraded(k)) for k in (2, 3, 2)]
    c = compare(reference, setting, SCENARIO.score_stats, resamples=300)
    assert all(d < 0 for d in c.per_seed)
    assert c.mean == pytest.approx(sum(c.per_seed) / 3)
    assert c.interval[0] < c.mean < c.interval[1] < 0
    assert c.t_interval[0] < c.mean < c.t_interval[1]


def test_seed_noise_widens_the_t_interval_beyond_the_differences_seen():
    lo, hi = t_interval([-1.0, 0.0, 1.0])
    assert lo < -1.0 and hi > 1.0  # 3 seeds: t = 4.30 with 2 degrees of freedom
    assert t_interval([0.5]) is None


def test_mismatched_seeds_or_sentences_are_refused():
    a = stats(REFS)
    with pytest.raises(ValueError, match="same seeds"):
        compare([a, a], [a], SCENARIO.score_stats)
    with pytest.raises(ValueError, match="same sentences"):
        compare([a], [a[:10]], SCENARIO.score_stats)
