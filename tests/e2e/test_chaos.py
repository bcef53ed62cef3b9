"""Chaos and WAN cuts on a whole two-site job (issue 12), through `nebula bench chaos`'s own functions
(nebula_lab/bench/chaos.py): real gateways and stages, SIGKILL, the supervisor's restarts, and the emulated
WAN's link cut (root). Each run is checked here against the example order itself (the bench compares
with its undisturbed run) and the final loss against the undisturbed run's. The default suite's run is
the example workload's (tests/e2e/jobs/pair.toml, paced so that kills land mid-job); the slow ones run
the bench's own jobs, ABNet's and ELECTRA's, as `nebula bench chaos` does."""
import re
from pathlib import Path

import pytest

from nebula.runtime.job import load_job
from nebula_lab.bench import chaos
from tests.support.electra import electra_job
from tests.support.electra import expected_ledger as electra_expected_ledger
from tests.support.sites import example_ledger, expected_ledger, job_file, write_job
from tests.support.wan import ROOT

# a step of ~0.3 s: seed 4's last kill (the source, 0.03 s after step 2) lands with 6 steps to go
PACED = {"pace_s = 0.025\neval_examples = 16": "pace_s = 0.1",
         "pace_s = 0.025\n\n[[links]]": "pace_s = 0.1\n\n[[links]]"}


def chaos_job(tmp_path: Path, seed: int, steps: int) -> Path:
    """The tiny ABNet job, as `nebula bench chaos --job tests/e2e/jobs/tiny.toml` runs it."""
    return chaos.prepare_job(write_job(tmp_path / "source"), tmp_path / f"seed-{seed}", steps=steps,
                             checkpoint_every=2, seed=seed)


def assert_as_scheduled(run: Path, job_file: Path, expected=expected_ledger) -> None:
    """Every stage applied each step of the example order once, in order (tests/e2e/test_two_sites.py)."""
    job = load_job(job_file)
    want = expected(job)
    for name in job.stages:
        assert chaos.ledger(run, name) == want, f"{name} in {run} did not apply every step once, as scheduled"


def assert_ok(row: dict) -> None:
    assert row["ok"], row["problems"]
    assert row["losses"] and all(loss["diff"] <= loss["noise"] for loss in row["losses"].values()), row["losses"]


def test_plan_is_seeded_and_leaves_the_last_quarter_to_finish_in(tmp_path):
    services = ["gateway-a", "gateway-b", "src", "sink"]
    first = chaos.plan(7, services, 10, 24)
    assert first == chaos.plan(7, services, 10, 24) != chaos.plan(8, services, 10, 24)
    assert len(first) == 10 and all(0 <= k.after_step <= 18 and 0 <= k.delay_s <= 1.5 for k in first)
    assert [k.after_step for k in first] == sorted(k.after_step for k in first)
    assert chaos.targets(load_job(job_file(tmp_path, "pair"))) == services


def test_three_kills_of_any_service_and_the_job_ends_as_undisturbed(tmp_path):
    """The fast variant: 3 kills in 8 steps (the slow tests below run 10 kills, three seeds, ABNet)."""
    job = chaos.prepare_job(job_file(tmp_path / "source", "pair", PACED), tmp_path / "seed-4", steps=8,
                            checkpoint_every=2, seed=4)
    row = chaos.run_kills(job, tmp_path / "seed-4", seed=4, kills=3)
    assert row["kills"] == 3 and row["restarts"] >= 3, row
    assert [kill["target"] for kill in row["schedule"]] == ["sink", "gateway-a", "src"]  # seed 4's plan
    assert_ok(row)
    assert_as_scheduled(tmp_path / "seed-4" / "chaos", job, example_ledger)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~4 min here; each seed may take 3x that on busy cores
def test_ten_kills_three_seeds_in_a_row(tmp_path):
    rows = []
    for seed in (1, 2, 3):
        job = chaos_job(tmp_path, seed=seed, steps=24)
        rows.append(chaos.run_kills(job, tmp_path / f"seed-{seed}", seed=seed, kills=10))
        row = rows[-1]
        chaos.print_row(row)  # the bench's table (pytest -s shows it)
        assert row["kills"] == 10 and row["restarts"] >= 10, row
        assert_ok(row)
        assert_as_scheduled(tmp_path / f"seed-{seed}" / "chaos", job)
    hit = {kill["target"] for row in rows for kill in row["schedule"]}
    assert hit == {"gateway-a", "gateway-b", "encoder", "decoder"}, f"the three seeds never killed {hit}"


RANKS_2 = {'impl = "electra-discriminator"': 'impl = "electra-discriminator"\nranks = 2'}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_kills_of_an_electra_job_hit_the_discriminator_ranks_too(tmp_path):
    """ELECTRA-Cloud with a discriminator of two data-parallel ranks: a rank's death takes its stage's
    ranks down and back together. Its steps are ~40 a second here, hence 120 of them."""
    source = electra_job(tmp_path / "source", RANKS_2)
    job = chaos.prepare_job(source, tmp_path / "seed-1", steps=120, checkpoint_every=10, seed=1)
    # a restart of both ranks on 2 busy cores can outlast the default peer_timeout (tests/e2e/test_electra.py)
    row = chaos.run_kills(job, tmp_path / "seed-1", seed=1, kills=10, channel={"peer_timeout": 120.0})
    chaos.print_row(row)
    assert row["kills"] == 10 and {"disc#0", "disc#1"} <= {kill["target"] for kill in row["schedule"]}, row
    assert row["ok"], row["problems"]
    loaded = load_job(job)
    for stage in loaded.stages:
        assert chaos.ledger(tmp_path / "seed-1" / "chaos", stage) == electra_expected_ledger(loaded, ["generator"])
    assert row["losses"]["generator"]["max_step_diff"] == 0.0  # its resumes are exact
    # the discriminator's are not, though within noise: a resumed rank 1 takes rank 0's RNG state
    # (nebula/runtime/ranks.py, "restore"), so its dropout masks differ from the undisturbed run's
    assert row["losses"]["disc"]["diff"] <= row["losses"]["disc"]["noise"]


# --- WAN cuts (root) --------------------------------------------------------------------------------------
@pytest.mark.root
@ROOT
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the 5 min cut alone is 300 s
@pytest.mark.parametrize("cut_s", [30, 300], ids=["30s", "5min"])
def test_a_cut_shorter_than_wan_timeout_is_ridden_out(tmp_path, cut_s):
    """The same processes carry on when the link is back: nothing restarts, nothing resumes from a
    checkpoint, every step once, and the first step comes within seconds."""
    job = chaos_job(tmp_path, seed=1, steps=10)
    row = chaos.run_cut(job, tmp_path / "seed-1", cut_s, at_step=3)
    chaos.print_row(row)
    assert row["stopped"] is None and row["restarts"] == 0, row
    assert row["resumed_from"] == [], f"resumed from checkpoints {row['resumed_from']}: a stage restarted"
    assert_ok(row)
    assert_as_scheduled(tmp_path / "seed-1" / "cut", job)
    # gateways retry a connect every 3 s (not TCP's SYN backoff); the stages then resend at once
    assert row["resume_s"] < 6, f"the first step came {row['resume_s']} s after the link returned"
    # during the cut each stage pings its one peer across it once a second, and resends nothing
    # until the peer answers again: its gateway refuses (unreachable) little more than those pings
    assert all(n <= 1.3 * cut_s for n in row["unreachable_refusals"].values()), row["unreachable_refusals"]


@pytest.mark.root
@ROOT
@pytest.mark.slow
def test_a_cut_longer_than_wan_timeout_stops_the_job_cleanly_and_it_resumes(tmp_path):
    job = chaos_job(tmp_path, seed=1, steps=10)
    row = chaos.run_cut(job, tmp_path / "seed-1", 30, at_step=3, wan_timeout=8)
    chaos.print_row(row)
    stopped = row["stopped"]
    assert stopped is not None, "the job rode out a cut longer than wan_timeout"
    assert stopped["exit_codes"] == {"encoder": 3, "decoder": 3}, stopped  # exit 3: the supervisor does not retry
    assert stopped["after_s"] < 25, stopped  # heartbeats find the cut in ~5 s, then wan_timeout
    assert "wan_timeout 8 s" in stopped["message"] and "unreachable" in stopped["message"], stopped
    assert re.search(r"resume from the newest checkpoint every stage holds \((en|de)coder's newest: \S+/step-\d+\.pt\)",
                     stopped["message"]), stopped
    assert row["resumed_from"] and row["resumed_from"][-1] >= 2, row  # the checkpoint before the cut (every 2)
    assert_ok(row)
    assert_as_scheduled(tmp_path / "seed-1" / "cut", job)
