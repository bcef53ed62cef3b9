"""`nebula electra seeds --parallel --until --resume`: seeds' one-site runs N at a time, in stages, continued.

A run trained in stages (to step 4, then on to 8, as a plan that spans sessions does) must end where the same
seed trained in one go ends, float for float (dropout 0, one thread: the stages are deterministic), and the
step reached by each stage must be kept although later steps prune it. The job files of a resume must be
the first run's: another option is refused before anything is trained.
"""
from pathlib import Path

import pytest

from nebula.errors import ConfigError
from nebula.runtime.job import load_job
from nebula.runtime.onesite import run_one_site
from services.electra import lanes, seeds
from tests.support.electra import electra_job
from tests.support.sites import records

ONE_SITE_DETERMINISTIC = {'address = "b/disc/0"': 'address = "a/disc/0"', "ffn = 64}": "ffn = 64, dropout = 0.0}"}
STAGES = ["generator", "disc"]


def losses(workdir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(workdir / "disc" / "metrics.jsonl", "step")]


def test_three_seeds_train_two_at_a_time_in_stages_and_end_where_one_go_ends(tmp_path):
    run = tmp_path / "run"
    files = {}
    for seed in (5, 6, 7):  # the third waits for a free lane
        files[seed] = electra_job(tmp_path / f"job-{seed}", {**ONE_SITE_DETERMINISTIC, "seed = 1": f"seed = {seed}"})
    times = lanes.train(run, files, STAGES, "disc", until=4, parallel=2)
    assert set(times) == {"seed-5", "seed-6", "seed-7"}
    first = {seed: losses(run / f"seed-{seed}" / "one-site") for seed in files}
    for seed in files:
        assert [s for s, _ in first[seed]] == [1, 2, 3, 4]  # stopped at 4 of 8
        assert lanes.done(run / f"seed-{seed}" / "kept" / "disc" / "step-00000004.pt")
    assert first[5] != first[6] != first[7]  # the seeds are different runs

    assert lanes.train(run, files, STAGES, "disc", until=4, parallel=2) == {}  # there already: nothing started
    assert lanes.newest(run, 5, "disc") == 4  # where the next stage resumes
    lanes.train(run, {5: files[5]}, STAGES, "disc", until=8, parallel=2)  # one seed on: the suite's time
    staged = losses(run / "seed-5" / "one-site")
    assert [s for s, _ in staged] == list(range(1, 9))  # resumed at 4: each step once
    assert lanes.checkpoint(run, 5, "disc", 4) == run / "seed-5" / "kept" / "disc" / "step-00000004.pt"

    straight = tmp_path / "straight"
    run_one_site(load_job(files[5]), straight, quiet=True, timeout=300)
    assert staged == losses(straight)  # stopping at 4 and resuming from its checkpoint changed no float


def test_a_resume_with_other_options_is_refused_before_anything_runs(tmp_path):
    run = tmp_path / "run"
    plan, training = seeds.Plan(cross_site=False, resume=False), seeds.Training(32, 200, True)
    gen, files = seeds.jobs(run, [21, 22], 2000, 100, 500, training, plan)
    train = load_job(files[21]["one-site"]).train
    assert (train.batch_size, train.checkpoint_every, train.seed) == (32, 500, 21)
    disc = load_job(files[21]["one-site"]).stage("disc")
    assert disc.options.warmup_steps == 200 and disc.threads == 1
    assert not (run / "seed-21" / "two-site.toml").exists()  # one site only: no cross-site job written

    resumed = seeds.Plan(cross_site=False, resume=True)
    assert seeds.jobs(run, [21, 22], 2000, 100, 500, training, resumed) == (gen, files)  # the same: accepted
    with pytest.raises(ConfigError, match="--resume: .*one-site.toml differs"):
        seeds.jobs(run, [21, 22], 2000, 100, 500, seeds.Training(16, 200, True), resumed)
    with pytest.raises(ConfigError, match="no earlier run"):
        seeds.jobs(tmp_path / "empty", [21, 22], 2000, 100, 500, training, resumed)


@pytest.mark.parametrize("plan, message", [
    (seeds.Plan(cross_site=False, until=750), "--until 750: a multiple of 500"),
    (seeds.Plan(parallel=2), "add --one-site-only"),
    (seeds.Plan(cross_site=False, until=2000, evaluate_at=[500]), "--evaluate-at .* unless"),
])
def test_plans_that_cannot_run_say_why(plan, message):
    with pytest.raises(ConfigError, match=message):
        seeds.check_plan(plan, 4000)


def test_the_summary_says_which_step_of_which_schedule_and_split_it_read():
    row = {"task": "alignment es-en", "metric": "accuracy", "baseline": "0.500", "before": [0.5, 0.5],
           "after": [0.6, 0.62], "change": 0.11, "interval": (0.1, 0.12), "seed_interval": (0.05, 0.17),
           "seed_spread": (0.1, 0.12), "trained_on": True, "verdict": "better", "seed_verdict": "better"}
    learnt = {"seeds": 2, "rows": [row], "split": "valid", "sequences": 64, "corruptor": "G", "seed": 0}
    result = {"seeds": [21, 22], "steps": 20000, "until": 10000, "split": "valid", "learnt": learnt, "earlier": {}}
    text = seeds.format_result(result)
    assert "(step 10000 of a 20000-step schedule), valid split, over seeds [21, 22]" in text
    assert "+0.110 [+0.100, +0.120]" in text and "[+0.050, +0.170]" in text
    assert "(2000 steps), test split" in seeds.format_result({**result, "steps": 2000, "until": 2000, "split": "test"})
