"""The held-out evaluations of ELECTRA-Cloud (services/electra/heldout.py, compare.py, paired.py) on tiny real
stages (the real tokenizer and vocabulary, tests/support/electra's tiny corpus):

- RTD is scored over the tokens G may mask: never a special (`<s>`, `</s>`), which are real in every sequence
  and would hand any D that learnt "a special is real" free AUC;
- the alignment test's shared-token baseline ranks a pair by the English tokens its source shares, and D is
  also scored on the pairs where that baseline has no cue; `nebula electra eval` reports D against it;
- over several seeds every change carries Student's t interval over the per-seed changes beside the item-level
  bootstrap; one seed has none;
- `--split valid` evaluates the valid split, so that a setting is chosen without looking at test."""
import statistics

import pytest
import torch

from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from nebula.runtime.service import build_stage
from services.electra import heldout
from services.electra.compare import OWN_FIRST, Setting, evaluate_runs, format_rows
from services.electra.paired import Ratio, compare, t_interval
from tests.support.electra import electra_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return load_job(electra_job(tmp_path_factory.mktemp("electra")))


@pytest.fixture(scope="module")
def stages(job, tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return build_stage(job, "generator", root / "g", quiet=True), build_stage(job, "disc", root / "d", quiet=True)


def test_rtd_scores_only_the_tokens_g_may_mask(stages):
    gen, disc = stages
    corruption = heldout.fixed_corruption(gen, 6, seed=3)
    scores = heldout.score_discriminator(disc, corruption)
    last_special = max(disc.specials.as_list())
    real = corruption.tokens != disc.specials.pad
    maskable = real & (corruption.originals > last_special)
    assert (real & ~maskable).any()  # every sequence has its <s> and </s>: they were counted before
    assert len(scores.rtd) == len(scores.labels) == int(maskable.sum())
    assert torch.equal(scores.sequence, maskable.nonzero()[:, 0])
    assert scores.labels.sum() > 0  # the replaced tokens are all among them (G never masks a special)
    assert int(scores.labels.sum()) <= int(corruption.at.sum())


def test_the_shared_token_baseline_counts_what_the_halves_share():
    assert heldout.shared_tokens([5, 6, 7], [7, 8, 7, 9]) == 2  # both 7s of the English half
    assert heldout.shared_tokens([], [1, 2]) == 0
    rows = torch.zeros(4, 3, dtype=torch.long)
    mask = torch.ones(4, 3, dtype=torch.bool)
    pairs = heldout.AlignmentSet(rows, rows, mask, mask, torch.tensor([3.0, 0, 1, 2]), torch.tensor([1.0, 0, 1, 4]))
    ones = torch.ones(1, 4, dtype=torch.float64)
    assert float(heldout.shared_token_hits(pairs)(ones)[0]) == pytest.approx((1 + 0.5 + 0.5 + 0) / 4)


def test_alignment_against_the_baseline_and_without_its_cue(job, stages, tmp_path):
    """Two seeds of an untrained D (as built, the same weights): every change is 0 and both intervals hold it;
    the baseline's row compares it with D, and the no-cue row counts only the pairs the baseline ties on."""
    _, disc = stages
    pairs = heldout.alignment_set(disc, job.data, "es-en", 20, seed=0)
    tied = pairs.shared_true == pairs.shared_shuffled
    assert 0 < int(tied.sum()) < len(tied)  # UI strings share numbers and placeholders with their translation
    cue = heldout.alignment_hits(disc, pairs, no_shared_cue=True)
    assert torch.equal(cue.counts, tied.double()) and bool((cue.hits <= cue.counts).all())

    result = evaluate_runs(Setting(job, None, sequences=6, pairs=20, encoder_evals=False), [(None, None)] * 2)
    rows = {(r["task"], r["metric"]): r for r in result["rows"]}
    auc = rows[("RTD", "ROC-AUC, real vs replaced")]
    assert auc["change"] == 0 and auc["seed_interval"] == [0, 0] and auc["seed_verdict"] == "within"
    own = rows[("alignment es-en", OWN_FIRST)]
    versus = next(r for r in result["rows"] if r["baseline"] == "copy")
    copy = float(heldout.shared_token_hits(pairs)(torch.ones(1, len(pairs.true), dtype=torch.float64))[0])
    assert versus["before"] == [pytest.approx(copy)] * 2 and versus["after"] == own["after"]
    assert versus["change"] == pytest.approx(statistics.fmean(own["after"]) - copy)
    no_cue = next(r for r in result["rows"] if "no shared-token cue" in r["metric"])
    assert f"{int(tied.sum())} pairs with no shared-token cue" in no_cue["metric"]
    text = format_rows(result)
    assert "[95% t over seeds]" in text and "held-out test packages" in text


def test_the_valid_split_is_evaluated_where_asked(job):
    result = evaluate_runs(Setting(job, None, sequences=4, pairs=20, encoder_evals=False, split="valid"),
                           [(None, None)])
    assert result["split"] == "valid" and "held-out valid packages" in format_rows(result)
    with pytest.raises(ConfigError, match="held-out split"):
        evaluate_runs(Setting(job, None, split="train"), [(None, None)])


def test_t_interval_over_seeds():
    lo, hi = t_interval([1.0, 2.0, 3.0])
    assert (lo, hi) == (pytest.approx(2 - 4.303 / 3 ** 0.5), pytest.approx(2 + 4.303 / 3 ** 0.5))
    assert t_interval([1.0]) is None
    wide = t_interval([0.0] * 40 + [1.0])  # df 40: the table's next lower entry (30), never a narrower one
    assert wide[1] - wide[0] == pytest.approx(2 * 2.042 * statistics.stdev([0.0] * 40 + [1.0]) / 41 ** 0.5)
    n = 50
    hits = lambda p: Ratio((torch.arange(n) % 10 < p * 10).double())  # noqa: E731
    one = compare([hits(0.5)], [hits(0.7)], n, 0)
    assert one["seed_interval"] is None and one["seed_verdict"] is None and one["verdict"] == "better"
    three = compare([hits(0.5)] * 3, [hits(0.6), hits(0.7), hits(0.8)], n, 0)
    assert three["seed_changes"] == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)]
    # the items say better; three seeds this far apart do not (the "+0.040 [+0.027, +0.054]" case)
    assert three["verdict"] == "better" and three["seed_verdict"] == "within"
    half = 0.1 * 4.303 / 3 ** 0.5
    assert three["seed_interval"] == [pytest.approx(0.2 - half), pytest.approx(0.2 + half)]
