"""The pieces of `nebula demo electra` that need no training: the verdict on the switch, the run
directory, the job copies, the one-site/two-site pairing, and `nebula demo`'s workload argument."""
import random

import pytest

from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from services.electra.demo import (
    DEFAULT_JOB,
    DEFAULT_ONE_SITE_JOB,
    adapt_job,
    check_pair,
    fresh_run_dir,
    switch_verdict,
)

SWITCH, NOISE = 150, 0.3


def loss_curve(jump: float = 0.0, seed: int = 0) -> list[tuple[int, float]]:
    """A decaying loss with independent per-step noise; `jump` added to every step after the switch."""
    rng = random.Random(seed)
    return [(s, 5 + 20 * 0.99 ** s + rng.gauss(0, NOISE) + (jump if s > SWITCH else 0)) for s in range(1, 301)]


def test_a_continuation_of_the_same_curve_is_no_jump():
    verdicts = [switch_verdict(loss_curve(seed=seed), SWITCH) for seed in range(20)]
    assert sum(v["ok"] for v in verdicts) >= 19  # a 3-sigma rule: about 1 in 370 false alarms
    assert all(abs(v["sigma"] - NOISE) < 0.1 for v in verdicts)  # the noise it measures is the curve's


def test_a_step_of_a_few_noise_widths_is_a_jump_either_way():
    for jump in (2.0, -2.0):
        v = switch_verdict(loss_curve(jump=jump), SWITCH)
        assert v["ok"] is False and v["jump"] == pytest.approx(jump, abs=0.6)


def test_too_few_steps_are_not_judged():
    v = switch_verdict(loss_curve()[:12], 8)
    assert v["ok"] is None and "too few steps" in v["why"]


def test_a_run_dir_with_files_is_refused_and_kept(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="already holds files"):
        fresh_run_dir(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"
    fresh_run_dir(tmp_path / "new" / "run")  # a new or empty directory is fine
    fresh_run_dir(tmp_path / "new" / "run")


def test_the_shipped_jobs_pair_up_and_a_mismatch_is_named(tmp_path):
    two = load_job(adapt_job(DEFAULT_JOB, tmp_path / "job.toml", 40, None))
    one = load_job(adapt_job(DEFAULT_ONE_SITE_JOB, tmp_path / "one.toml", 40, None))
    check_pair(one, two)
    assert two.data == one.data and two.train.steps == 40
    other = load_job(adapt_job(DEFAULT_ONE_SITE_JOB, tmp_path / "other.toml", 40,
                               {"train": {}, "stages": {"disc": {"lr": 1e-3}}}))
    with pytest.raises(ConfigError, match="stages and options"):
        check_pair(other, two)
    with pytest.raises(ConfigError, match="at one site"):
        check_pair(two, two)


def test_nebula_demo_takes_an_optional_workload(capsys):
    from nebula.cli import build_parser
    parser = build_parser()
    args = parser.parse_args(["demo", "--steps", "5", "--hot-start", "d"])
    assert (args.workload, args.steps, str(args.hot_start)) == ("abnet", 5, "d")
    assert parser.parse_args(["demo", "electra", "--one-site-steps", "3"]).workload == "electra"
    with pytest.raises(ConfigError, match="--hot-start is an option of `nebula demo abnet`"):
        args = parser.parse_args(["demo", "electra", "--hot-start", "d"])
        args.func(args)


def test_gs_mlm_phase_is_the_jobs_generator_alone_and_smaller_than_d(tmp_path):
    from services.electra.demo import GENERATOR_JOB, SETTINGS, adapted, generator_job
    from services.electra.model import Discriminator, Generator, Size
    from services.models.plm import BertModel
    raw = adapted(DEFAULT_JOB, 40, SETTINGS)
    job = load_job(adapt_job(DEFAULT_JOB, tmp_path / "job.toml", 40, SETTINGS))
    gen = generator_job(raw, job, None)
    shipped = load_job(GENERATOR_JOB)
    assert list(gen["stages"]) == ["generator"] and "links" not in gen  # G alone, no link to D
    # its weights carry over: the distillation job's model, trained with the MLM phase's dropout
    assert gen["stages"]["generator"]["size"] == {**SETTINGS["stages"]["generator"]["size"],
                                                  "dropout": shipped.stage("generator").options.size.dropout}
    assert gen["train"]["steps"] == shipped.train.steps  # its last step is checkpointed, as every job's is
    assert gen["train"]["checkpoint_every"] == min(shipped.train.steps, 1000)  # a stopped phase loses <= 1,000
    assert gen["stages"]["generator"]["lr"] == shipped.stage("generator").options.lr
    assert gen["stages"]["generator"]["warmup_steps"] == shipped.stage("generator").options.warmup_steps
    assert generator_job(raw, job, 0) is None
    with pytest.raises(ConfigError, match="--generator-steps -1"):
        generator_job(raw, job, -1)

    def params(module) -> int:
        return sum(p.numel() for p in module.parameters())
    vocab, sizes = 28_902, SETTINGS["stages"]
    g = params(Generator(Size(**sizes["generator"]["size"]).bert(vocab, 128)))
    d = params(Discriminator(BertModel(Size(**sizes["disc"]["size"]).bert(vocab, 128))))
    assert 0.35 < g / d < 0.45  # the paper's G is about 40% of its D


def _summary(auc_change: float, alignment_change: float) -> dict:
    """A demo summary whose evaluation rows come from services.electra.paired.compare on real scores."""
    import torch

    from services.electra.compare import row
    from services.electra.paired import Ratio, compare
    n = 200
    hits = lambda p: Ratio((torch.arange(n) % 100 < p * 100).double())  # noqa: E731
    rows = [row("MLM", "corruptor G, masked-token accuracy", "unigram", compare([hits(0.05)], [hits(0.3)], n, 0)),
            row("RTD", "ROC-AUC, real vs replaced", "0.5", compare([hits(0.5)], [hits(0.5 + auc_change)], n, 0)),
            row("alignment es-en", "own translation ranked first", "0.5",
                compare([hits(0.5)], [hits(0.5 + alignment_change)], n, 0))]
    return {"evaluation": {"rows": rows, "sequences": n}, "steps": 300, "one_site_steps": 150,
            "generator_steps": 400, "verdicts": {"disc": {"ok": True}}}


def test_the_plain_words_follow_the_verdicts():
    from services.electra.demo_report import shows
    good = shows(_summary(0.3, 0.2))
    assert good.startswith("What this run shows (D learnt)") and "What it does not show" in good
    assert "after 400 MLM steps alone, predicts 30.0% of held-out masked tokens" in good
    assert "ROC-AUC after 300 steps (150 on one site, 150 across two) from 0.500 untrained to 0.800" in good
    assert "an improvement" in good and "no jump" in good
    flat = shows(_summary(0.3, 0.0))
    assert "not shown on every target evaluation" in flat and "no change beyond the interval" in flat
    assert "a scorer that sees only the tokens the halves share" in flat and "t interval over those seeds" in flat
    assert "t interval over those seeds" not in good
